"""Torch microbenchmark of one engine step for a decoder model shape (random weights, no download).

One point is a batch as vLLM schedules it: an optional prefill chunk of ``p`` tokens after
``pc`` tokens of context, plus ``nd`` sequences of ``q`` tokens each (``q = 1`` decode,
``q = 1 + k`` speculative verify) after ``dc`` tokens of context. The target pass runs
``num_layers_timed`` Llama-style decoder layers (RMSNorm, fused QKV, rotary, KV written into a
preallocated cache by slot, SDPA with GQA and a lower-right causal mask, fused gate-up, SiLU,
down projection), then the final norm, the LM head over the sampled rows and a greedy
sample; its step time is ``layers · num_hidden_layers / num_layers_timed + head``. The
drafter's pass (an EAGLE/MTP head) is the fc over ``[embedding, hidden]``, one decoder layer
and the LM head. All layers share one layer's weights and KV buffer: the same bytes and FLOPs
per layer, in the memory of one.

On CUDA each pass is timed with CUDA events (median of repeats after warm-up); on CPU with
``perf_counter`` on one thread, keeping the fastest repeat (on a shared CPU noise only adds
time). The sweep is designed, not a grid: a few values per quantity, shuffled per kind and
interleaved across kinds, so that a run cut short by its time budget still covers prefill,
decode, mixed, verify and draft points. Only this module imports torch.
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass

from kvsim.errors import ConfigError

DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


@dataclass(frozen=True, slots=True)
class Point:
    kind: str  # prefill, decode, mixed, verify (all target) or draft
    p: int  # prefill chunk tokens (0: none)
    pc: int  # context before the chunk
    nd: int  # decode/verify sequences
    q: int  # tokens per decode sequence (1 + k when verifying)
    dc: int  # context before each decode sequence

    @property
    def num_tokens(self) -> int:
        return self.p + self.nd * self.q

    @property
    def num_sampled(self) -> int:
        """Rows through the LM head: the chunk's last token, every verified decode position."""
        return self.nd * self.q + (1 if self.p else 0)

    @property
    def num_slots(self) -> int:
        return (self.pc + self.p if self.p else 0) + self.nd * (self.dc + self.q)


# Sweep ranges per device: (prefill chunks, prefill contexts, decode batches, decode contexts).
RANGES = {
    "cuda": ((64, 256, 512, 1024, 2048), (0, 1024, 4096, 16384), (1, 8, 32, 64, 128, 256),
             (128, 1024, 4096, 16384)),
    "cpu": ((16, 64, 128, 256), (0, 512, 2048), (1, 4, 16, 32), (128, 512, 2048)),
}
VERIFY_WIDTHS = (2, 4, 6)  # 1 + k for k = 1, 3, 5


def design(device: str, max_num_batched_tokens: int, seed: int = 0) -> list[Point]:
    """The designed sweep: per kind a shuffled small factorial, interleaved round-robin."""
    chunks, pctx, batches, dctx = RANGES[device]
    rng = random.Random(seed)
    kinds = {
        "prefill": [Point("prefill", p, c, 0, 1, 0) for p, c in itertools.product(chunks, pctx)],
        "decode": [Point("decode", 0, 0, b, 1, c) for b, c in itertools.product(batches, dctx)],
        "mixed": [Point("mixed", p, c, b, 1, d) for p, c, b, d in
                  itertools.product(chunks[1::2], pctx[:2], batches[1::2], dctx[::2])],
        "verify": [Point("verify", 0, 0, b, q, c) for b, q, c in
                   itertools.product(batches, VERIFY_WIDTHS, dctx)],
        "draft": ([Point("draft", 0, 0, b, 1, c) for b, c in itertools.product(batches, dctx)]
                  + [Point("draft", p, c, 0, 1, 0) for p, c in itertools.product(chunks, pctx[:2])]),
    }
    for pts in kinds.values():
        rng.shuffle(pts)
    queues = [[p for p in pts if p.num_tokens <= max_num_batched_tokens] for pts in kinds.values()]
    out = []
    for group in itertools.zip_longest(*queues):
        out += [p for p in group if p is not None]
    return out


def _import_torch():
    try:
        import torch
    except ImportError:
        raise ConfigError("--device", "calibration needs torch: pip install 'kvsim[calibrate]'") from None
    return torch


class Bench:
    """One decoder layer's weights, the LM head, the EAGLE fc and a KV buffer on ``device``."""

    def __init__(self, model, device: str, dtype: str, num_slots: int, seed: int = 0):
        torch = self.torch = _import_torch()
        if device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device", "cuda requested, but torch sees no CUDA device "
                              f"(torch {torch.__version__})")
        self.device = torch.device(device)
        self.dtype = getattr(torch, DTYPES[dtype])
        self.m = model
        torch.manual_seed(seed)
        h, d = model.hidden_size, model.head_dim
        self.num_heads, self.num_kv_heads = model.num_attention_heads, model.num_key_value_heads
        qkv = (self.num_heads + 2 * self.num_kv_heads) * d

        def w(*shape):
            return (torch.randn(*shape, device=self.device, dtype=self.dtype) * 0.02)

        self.w_qkv, self.w_o = w(qkv, h), w(h, self.num_heads * d)
        self.w_gate_up, self.w_down = w(2 * model.intermediate_size, h), w(h, model.intermediate_size)
        self.norm1, self.norm2 = w(h) + 1, w(h) + 1
        self.w_lm, self.w_fc = w(model.vocab_size, h), w(h, 2 * h)
        self.k_cache = w(num_slots, self.num_kv_heads, d)
        self.v_cache = w(num_slots, self.num_kv_heads, d)
        half = d // 2
        inv = 1.0 / (10000 ** (torch.arange(half, device=self.device, dtype=torch.float32) / half))
        self.inv_freq = inv
        self.device_name = (torch.cuda.get_device_name(self.device) if device == "cuda"
                            else _cpu_name())

    # -- the model ------------------------------------------------------------------------

    def _rms(self, x, weight):
        torch = self.torch
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + 1e-6)).to(x.dtype) * weight

    def _rope(self, x, cos, sin):
        x1, x2 = x.chunk(2, dim=-1)
        return self.torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def prepare(self, pt: Point):
        """Inputs of one point: hidden states, positions' cos/sin, KV slots, attention views."""
        torch, d = self.torch, self.m.head_dim
        pos = []
        if pt.p:
            pos.append(torch.arange(pt.pc, pt.pc + pt.p))
        for _ in range(pt.nd):
            pos.append(torch.arange(pt.dc, pt.dc + pt.q))
        pos_t = torch.cat(pos).to(self.device)
        freqs = pos_t[:, None].float() * self.inv_freq[None, :]
        cos, sin = freqs.cos()[:, None, :].to(self.dtype), freqs.sin()[:, None, :].to(self.dtype)
        slots, views, off = [], [], 0
        if pt.p:
            n = pt.pc + pt.p
            slots.append(torch.arange(pt.pc, n))
            views.append((slice(0, n), 1, n, pt.p))
            off = n
        if pt.nd:
            n = pt.dc + pt.q
            base = off + torch.arange(pt.nd)[:, None] * n + pt.dc
            slots.append((base + torch.arange(pt.q)[None, :]).reshape(-1))
            views.append((slice(off, off + pt.nd * n), pt.nd, n, pt.q))
        x = torch.randn(pt.num_tokens, self.m.hidden_size, device=self.device, dtype=self.dtype)
        sample_idx = []
        if pt.p:
            sample_idx.append(pt.p - 1)
        sample_idx += [pt.p + i * pt.q + j for i in range(pt.nd) for j in range(pt.q)]
        return (x, cos, sin, torch.cat(slots).to(self.device), views,
                torch.tensor(sample_idx, device=self.device), d)

    def layer(self, x, inp):
        """One decoder layer over the point's tokens (writes their K and V into the cache)."""
        torch = self.torch
        F = torch.nn.functional
        from torch.nn.attention.bias import causal_lower_right

        _, cos, sin, slots, views, _, d = inp
        t = x.shape[0]
        qkv = self._rms(x, self.norm1) @ self.w_qkv.T
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], -1)
        q = self._rope(q.view(t, self.num_heads, d), cos, sin)
        k = self._rope(k.view(t, self.num_kv_heads, d), cos, sin)
        self.k_cache.index_copy_(0, slots, k)
        self.v_cache.index_copy_(0, slots, v.view(t, self.num_kv_heads, d))
        outs, start = [], 0
        for region, b, n, nq in views:
            qq = q[start:start + b * nq].view(b, nq, self.num_heads, d).transpose(1, 2)
            kk = self.k_cache[region].view(b, n, self.num_kv_heads, d).transpose(1, 2)
            vv = self.v_cache[region].view(b, n, self.num_kv_heads, d).transpose(1, 2)
            o = self._attention(F, causal_lower_right, qq, kk, vv, nq, n)
            outs.append(o.transpose(1, 2).reshape(b * nq, self.num_heads * d))
            start += b * nq
        x = x + torch.cat(outs) @ self.w_o.T
        gate, up = (self._rms(x, self.norm2) @ self.w_gate_up.T).chunk(2, dim=-1)
        return x + (F.silu(gate) * up) @ self.w_down.T

    dense_mask = False  # set when this torch build refuses a CausalBias with GQA

    def _attention(self, F, causal_lower_right, q, k, v, nq, n):
        """SDPA with GQA; queries aligned to the end of the keys (lower-right causal)."""
        if nq == 1:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        if not self.dense_mask:
            try:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(nq, n),
                                                      enable_gqa=True)
            except (RuntimeError, TypeError, NotImplementedError):
                self.dense_mask = True
        mask = self.torch.ones(nq, n, dtype=self.torch.bool, device=q.device).tril(n - nq)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def head(self, x, inp):
        """Final norm, LM head over the sampled rows, greedy sample."""
        return (self._rms(x[inp[5]], self.norm2) @ self.w_lm.T).argmax(-1)

    # -- timing ---------------------------------------------------------------------------

    def _sync(self):
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def time_point(self, pt: Point, num_layers_timed: int, reps: int, warmup: int):
        """Median seconds of (layers, head) for one point; the draft pass adds the EAGLE fc."""
        torch = self.torch
        inp = self.prepare(pt)
        layers = []
        head = []
        with torch.inference_mode():
            for i in range(warmup + reps):
                x = inp[0]
                self._sync()
                if self.device.type == "cuda":
                    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                    ev[0].record()
                else:
                    t0 = time.perf_counter()
                if pt.kind == "draft":
                    x = torch.cat([x, x], dim=-1) @ self.w_fc.T
                for _ in range(1 if pt.kind == "draft" else num_layers_timed):
                    x = self.layer(x, inp)
                if self.device.type == "cuda":
                    ev[1].record()
                    self.head(x, inp)
                    ev[2].record()
                    torch.cuda.synchronize()
                    lay_s, head_s = ev[0].elapsed_time(ev[1]) / 1e3, ev[1].elapsed_time(ev[2]) / 1e3
                else:
                    t1 = time.perf_counter()
                    self.head(x, inp)
                    lay_s, head_s = t1 - t0, time.perf_counter() - t1
                if i >= warmup:
                    layers.append(lay_s)
                    head.append(head_s)
        if self.device.type == "cpu":  # contention only ever adds time: keep the fastest repeat
            return min(layers), min(head)
        return _median(layers), _median(head)


def _median(xs):
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def _cpu_name() -> str:
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return "CPU " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU " + (platform.processor() or platform.machine())


def run_sweep(model, model_name: str, device: str, dtype: str, budget_s: float,
              max_num_batched_tokens: int, num_layers_timed: int | None = None, seed: int = 0,
              log=None) -> list[dict]:
    """Measure the designed sweep until ``budget_s`` runs out; CSV-ready rows (target, draft)."""
    from kvsim.cost.fitted import SHAPE_KEYS

    points = design(device, max_num_batched_tokens, seed)
    num_slots = max(p.num_slots for p in points)
    start = time.monotonic()
    bench = Bench(model, device, dtype, num_slots, seed)
    torch = bench.torch
    if num_layers_timed is None:
        num_layers_timed = model.num_hidden_layers if device == "cuda" else 1
    reps, warmup = (10, 3) if device == "cuda" else (5, 1)
    if device == "cpu":
        # One thread: on a shared machine more threads than free cores make timings erratic.
        torch.set_num_threads(1)
    common = {"source": "kvsim-bench", "device": bench.device_name, "torch_version": torch.__version__,
              "dtype": dtype, "model": model_name, **{k: getattr(model, k) for k in SHAPE_KEYS},
              "tensor_parallel_size": 1}
    rows, last_s = [], 0.0
    for i, pt in enumerate(points):
        elapsed = time.monotonic() - start
        if elapsed + last_s * 1.5 > budget_s:
            break
        t = time.monotonic()
        layers_s, head_s = bench.time_point(pt, num_layers_timed, reps, warmup)
        last_s = time.monotonic() - t
        draft = pt.kind == "draft"
        timed = 1 if draft else num_layers_timed
        step_s = layers_s * (1 if draft else model.num_hidden_layers / timed) + head_s
        rows.append({**common, "num_layers_timed": timed, "kind": pt.kind,
                     "pass": "draft" if draft else "target", "num_prefill_tokens": pt.p,
                     "prefill_context": pt.pc, "num_decode_seqs": pt.nd, "decode_query_len": pt.q,
                     "decode_context": pt.dc, "num_sampled": pt.num_sampled,
                     "layers_s": f"{layers_s:.6g}", "head_s": f"{head_s:.6g}", "step_s": f"{step_s:.6g}"})
        if log is not None:
            log(f"[{i + 1}/{len(points)}] {pt.kind:7} p={pt.p} pc={pt.pc} nd={pt.nd} q={pt.q} "
                f"dc={pt.dc}: {step_s * 1e3:.2f} ms")
    return rows
