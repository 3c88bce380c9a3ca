"""Replay requests into a real vLLM engine (in-process ``LLM``) and measure them.

Runs inside the engine environment (``make_engine_env.sh``), never inside kvsim's:

    python engine_driver.py IN.json OUT.json
    python engine_driver.py --make-model SHAPE_JSON DIR   (only build the checkpoint)

``IN.json`` holds ``model`` (the Llama shape to build, or reuse, as a random-weight
checkpoint in ``model_dir``), ``engine`` (vLLM engine arguments) and ``phases``: named lists,
run in order, of requests (``req_id``, ``prompt_token_ids``, ``max_tokens``, ``arrival_s``). Each phase starts
on an empty prefix cache and replays its requests open loop: the driver steps the engine
itself and adds a request once its arrival time has passed on the wall clock (time.monotonic,
the engine's own clock in-process). ``OUT.json`` gets the engine's resolved settings (the KV
block count it allocated, the batch limits, asynchronous scheduling), and per phase: per
request the cached tokens, the wall-clock times its first token and its last token came out
of ``LLMEngine.step`` (relative to the phase's t = 0), the engine's own request metrics, and
per step the scheduled chunks ``(new tokens, tokens computed before)``, the rows sampled and
the step's wall time; plus the engine's Prometheus counter deltas over the phase. On failure
``OUT.json`` is ``{"error": "..."}`` (one line).

A warm-up request (token ids no phase uses) runs first: the first request is slow.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

# Before vLLM is imported: in-process engine core, no model hub, passive OpenMP waits (without
# it in-process runs stall ~100 ms at times; reference section 14).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# GiB of KV cache when the scenario does not pin the block count (num_gpu_blocks_override).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:prompt_tokens",
            "vllm:generation_tokens", "vllm:num_preemptions", "vllm:spec_decode_num_drafts",
            "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")


def make_model(shape: dict, folder: Path) -> Path:
    """A random-weight Llama of ``shape`` saved in ``folder`` (built once; reused)."""
    if (folder / "config.json").exists() and any(folder.glob("*.safetensors")):
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"], head_dim=shape["head_dim"],
        max_position_embeddings=shape["max_position_embeddings"], torch_dtype="bfloat16",
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    tmp = folder.with_name(folder.name + f".partial-{os.getpid()}")
    model.save_pretrained(tmp)
    folder.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, folder)
    return folder


def draft_folder(target: Path, method: str) -> Path:
    """A drafter checkpoint folder holding only ``config.json`` (weights: ``load_format=dummy``).

    EAGLE: a one-layer Llama head on the target's width (vLLM names it ``EagleLlamaForCausalLM``);
    ``draft_model``: the target's own config (with dummy weights the drafter equals the target:
    full acceptance).
    """
    cfg = json.loads((target / "config.json").read_text())
    if method == "eagle":
        cfg.update(num_hidden_layers=1)
    folder = target.with_name(f"{target.name}-{method}-draft")
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def build_llm(model_dir: Path, engine: dict):
    from vllm import LLM

    kwargs = dict(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True,
                  disable_log_stats=False, enable_prefix_caching=engine["enable_prefix_caching"],
                  block_size=engine["block_size"], max_num_seqs=engine["max_num_seqs"],
                  max_num_batched_tokens=engine["max_num_batched_tokens"],
                  max_model_len=engine["max_model_len"],
                  enable_chunked_prefill=engine["enable_chunked_prefill"], seed=0)
    if engine.get("num_gpu_blocks_override"):
        kwargs["num_gpu_blocks_override"] = engine["num_gpu_blocks_override"]
    if engine.get("long_prefill_token_threshold"):
        kwargs["long_prefill_token_threshold"] = engine["long_prefill_token_threshold"]
    spec = engine.get("speculative")
    if spec:
        cfg = {"method": spec["method"], "num_speculative_tokens": spec["num_speculative_tokens"]}
        if spec["method"] != "ngram":
            cfg["model"] = str(draft_folder(model_dir, spec["method"]))
            kwargs["load_format"] = "dummy"
        kwargs["speculative_config"] = cfg
    return LLM(**kwargs)


def counters(llm) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name in COUNTERS and hasattr(m, "value"):
            out[m.name] = out.get(m.name, 0) + m.value
    return out


class StepLog:
    """Wraps the scheduler's ``schedule`` to record each batch's chunks."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.pending: list[list] = []
        original = scheduler.schedule

        def schedule(*args, **kwargs):
            out = original(*args, **kwargs)
            chunks, sampled = [], 0
            for rid, n in out.num_scheduled_tokens.items():
                req = scheduler.requests[rid]
                # schedule() has already advanced num_computed_tokens past this step's tokens.
                before = req.num_computed_tokens - n
                chunks.append([n, before])
                sampled += before + n >= req.num_prompt_tokens
            if chunks:
                self.pending.append([chunks, sampled])
            return out

        scheduler.schedule = schedule

    def take(self) -> list[list]:
        out, self.pending = self.pending, []
        return out


def replay(llm, steplog: StepLog, requests: list[dict]) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    before = counters(llm)
    todo = sorted(requests, key=lambda r: r["arrival_s"])
    results: dict[str, dict] = {}
    steps: list[dict] = []
    steplog.take()
    t0 = time.monotonic()
    nxt = 0
    while nxt < len(todo) or engine.has_unfinished_requests():
        now = time.monotonic() - t0
        while nxt < len(todo) and todo[nxt]["arrival_s"] <= now:
            r = todo[nxt]
            params = SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True,
                                    detokenize=False)
            engine.add_request(r["req_id"], TokensPrompt(prompt_token_ids=r["prompt_token_ids"]),
                               params)
            results[r["req_id"]] = {"added_s": time.monotonic() - t0, "num_output_tokens": 0}
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, todo[nxt]["arrival_s"] - (time.monotonic() - t0)))
            continue
        start = time.monotonic()
        outputs = engine.step()
        end = time.monotonic()
        batches = steplog.take()
        steps.append({"start_s": start - t0, "duration_s": end - start, "batches": batches})
        for out in outputs:
            res = results[out.request_id]
            n = len(out.outputs[0].token_ids) if out.outputs else 0
            if n and "first_token_s" not in res:
                res["first_token_s"] = end - t0
            res["num_output_tokens"] = n
            if out.finished:
                res["finish_s"] = end - t0
                res["num_cached_tokens"] = out.num_cached_tokens
                m = out.metrics
                if m is not None:
                    res["engine_metrics"] = {
                        k: getattr(m, k) for k in (
                            "arrival_time", "queued_ts", "scheduled_ts", "first_token_ts",
                            "last_token_ts", "first_token_latency", "num_generation_tokens")
                        if isinstance(getattr(m, k, None), int | float)}
    after = counters(llm)
    return {"requests": results, "steps": steps,
            "counters": {k: after.get(k, 0) - before.get(k, 0) for k in after}}


def run(spec: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    model_dir = make_model(spec["model"], Path(spec["model_dir"]))
    llm = build_llm(model_dir, spec["engine"])
    core = llm.llm_engine.engine_core.engine_core
    vc = llm.llm_engine.vllm_config
    resolved = {
        "vllm_version": __import__("vllm").__version__,
        "num_gpu_blocks": vc.cache_config.num_gpu_blocks,
        "block_size": vc.cache_config.block_size,
        "max_num_seqs": vc.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
        "max_model_len": vc.model_config.max_model_len,
        "async_scheduling": bool(vc.scheduler_config.async_scheduling),
        "enable_prefix_caching": bool(vc.cache_config.enable_prefix_caching),
        "enable_chunked_prefill": bool(vc.scheduler_config.enable_chunked_prefill),
    }
    steplog = StepLog(core.scheduler)
    # Warm-up (the first requests are slow), on ids from the top of the vocabulary that no
    # phase uses; then an empty cache.
    vocab = spec["model"]["vocab_size"]
    warm = [list(range(vocab - 1 - i * 300, vocab - 301 - i * 300, -1)) for i in range(2)]
    llm.generate([TokensPrompt(prompt_token_ids=w) for w in warm],
                 SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False),
                 use_tqdm=False)
    phases = {}
    for name, requests in spec["phases"].items():
        if not llm.reset_prefix_cache():
            raise RuntimeError("the engine could not reset its prefix cache")
        phases[name] = replay(llm, steplog, requests)
    return {"engine": resolved, "phases": phases}


def main() -> int:
    if sys.argv[1] == "--make-model":  # for a server: engine_driver.py --make-model SHAPE DIR
        print(make_model(json.loads(sys.argv[2]), Path(sys.argv[3])))
        return 0
    inp, out = Path(sys.argv[1]), Path(sys.argv[2])
    try:
        result = run(json.loads(inp.read_text()))
    except Exception as exc:  # reported as one line to kvsim, full trace on stderr
        traceback.print_exc()
        # One line: pydantic's errors put the reason on the lines after a header.
        result = {"error": " ".join(f"{type(exc).__name__}: {exc}".split())[:400]}
    out.write_text(json.dumps(result))
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
