"""A simulated request: vLLM's token model (``num_computed_tokens`` chasing ``num_tokens``).

There is no prefill or decode phase: each step the scheduler closes part of the gap between
``num_computed_tokens`` and ``num_tokens`` (prompt + accepted outputs). Prompts are held as
token-id sequences (explicit ids or ``[first_id, length]`` segments); generated tokens are
not modelled by content, so every output token of a request carries that request's own
``output_token_id``, which no other request shares (outputs of two requests never hit each
other's cache, as with sampled, non-identical completions).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from enum import Enum


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    # Holding blocks while a KV connector loads them (vLLM's WAITING_FOR_REMOTE_KVS).
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    FINISHED = "finished"


class ExplicitTokens:
    """A prompt given as a tuple of token ids."""

    __slots__ = ("ids",)

    def __init__(self, ids: tuple[int, ...]):
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def window(self, start: int, end: int) -> tuple[int, ...]:
        return self.ids[start:end]


def block_content(tokens: tuple[int, ...]):
    """The canonical form of one block's tokens, as block hashes key them: the first id
    when the ids run up by one (``a, a+1, ...``), ``(a,)`` when two or more are all ``a``
    (a request's output tokens), else the tuple itself. Equal tokens give equal forms (an
    int never equals a tuple; a block's tuple is as long as the block), and a run costs no
    long tuple."""
    a = tokens[0]
    size = len(tokens)
    if tokens[-1] - a == size - 1 and (size < 2 or tokens[1] == a + 1) and (
            size < 3 or tokens == tuple(range(a, a + size))):
        return a
    if tokens[-1] == a and tokens.count(a) == size:
        return (a,)
    return tokens


class SegmentTokens:
    """A prompt given as ``[first_token_id, length]`` runs: run ``(f, n)`` is ids ``f .. f+n-1``.

    Stored compactly; ``window`` materialises only the ids a block needs, so a 100k-token
    prompt costs a few integers until its blocks are hashed.
    """

    __slots__ = ("firsts", "offsets", "n")

    def __init__(self, segments: list[tuple[int, int]]):
        self.firsts = [first for first, _ in segments]
        self.offsets = []
        pos = 0
        for _, length in segments:
            self.offsets.append(pos)
            pos += length
        self.n = pos

    def __len__(self) -> int:
        return self.n

    def window(self, start: int, end: int) -> tuple[int, ...]:
        i = bisect_right(self.offsets, start) - 1
        if i + 1 == len(self.offsets) or end <= self.offsets[i + 1]:  # within one run
            base = self.firsts[i] - self.offsets[i]
            return tuple(range(base + start, base + end))
        out: list[int] = []
        pos = start
        while pos < end:
            seg_end = self.offsets[i + 1] if i + 1 < len(self.offsets) else self.n
            stop = min(end, seg_end)
            base = self.firsts[i] - self.offsets[i]
            out.extend(range(base + pos, base + stop))
            pos = stop
            i += 1
        return tuple(out)

    def block_contents(self, first: int, count: int, step: int, size: int) -> list | range:
        """``block_content`` of the ``count`` windows ``[first + k*step, + size)``, all inside
        the prompt; a window within one run is its first id without making the tuple."""
        offsets, firsts, n = self.offsets, self.firsts, self.n
        last = len(offsets) - 1
        i = bisect_right(offsets, first) - 1
        if first + (count - 1) * step + size <= (offsets[i + 1] if i < last else n):
            base = firsts[i] - offsets[i]  # every window within one run
            return range(base + first, base + first + count * step, step)
        out: list = []
        start, stop = first, first + count * step
        while start < stop:
            while i < last and offsets[i + 1] <= start:
                i += 1
            seg_end = offsets[i + 1] if i < last else n
            if start + size <= seg_end:  # this window and the next ones inside the run
                m = min((seg_end - size - start) // step + 1, (stop - start) // step)
                base = firsts[i] - offsets[i]
                out.extend(range(base + start, base + start + m * step, step))
                start += m * step
            else:
                out.append(block_content(self.window(start, start + size)))
                start += step
        return out


@dataclass(slots=True)
class KVTransferParams:
    """A request's ``kv_transfer_params`` in a P/D pair, as vLLM's NixlConnector reads and
    writes them (a dict there; the connector mutates some fields as vLLM's does).

    The proxy sends the prefill side ``do_remote_decode``; the prefill side's
    ``request_finished`` returns the decode side's: ``do_remote_prefill`` with the remote
    request's engine (an engine index here, vLLM's ``remote_engine_id``), id and blocks
    (``remote_num_blocks``: how many)."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine: int | None = None
    remote_request_id: str | None = None
    remote_num_blocks: int = 0  # len(remote_block_ids)
    p_side_truncated: bool = False  # vLLM's _p_side_truncated


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """An immutable workload record: what arrives, when, and how much it generates."""

    req_id: str
    arrival_s: float
    prompt: ExplicitTokens | SegmentTokens
    max_tokens: int
    priority: int = 0
    # Drafts accepted at the request's 1st, 2nd, ... verify step (cycled), from a trace.
    accepted: tuple[int, ...] | None = None
    # The conversation / session / user the request belongs to, where the workload says
    # (a cluster's session_affinity router keeps a session on one replica).
    session_id: str | None = None
    # Sent by a benchmark client before its measured run (left out of the metrics).
    warmup: bool = False


class Request:
    """Mutable per-request state inside the scheduler (mirrors ``vllm.v1.request.Request``)."""

    __slots__ = (
        "req_id", "seq", "arrival_s", "priority", "prompt", "num_prompt_tokens",
        "max_tokens", "output_token_id", "num_output_tokens", "num_computed_tokens", "status",
        "is_prefill_chunk", "num_preemptions", "block_hashes", "cached_tokens",
        "external_cached_tokens", "num_draft_tokens", "num_drafts_proposed",
        "num_drafts_accepted", "num_verify_steps",
        "accepted_trace", "group_keys", "num_output_placeholders", "num_in_flight_tokens",
        "num_stale_output_tokens", "drop_stale_output", "shared_prefix_boundary",
        "join_step", "first_scheduled_step", "first_token_step", "finish_step",
        "first_scheduled_s", "first_token_s", "finish_s", "session_id", "replica", "dp_rank",
        "rank", "lz_sched", "lz_upd", "lz_in", "last_sched_seq", "kv_transfer_params",
        "kv_transfer_output", "prefill_replica", "prefill_cached_tokens", "prefill_done_s",
        "warmup",
    )

    def __init__(self, spec: RequestSpec, seq: int):
        self.req_id = spec.req_id
        self.seq = seq
        self.arrival_s = spec.arrival_s
        self.priority = spec.priority
        self.prompt = spec.prompt
        self.num_prompt_tokens = len(spec.prompt)
        self.max_tokens = spec.max_tokens
        # Negative, so it can never equal a prompt token id (those are >= 0).
        self.output_token_id = -(seq + 1)
        self.num_output_tokens = 0
        self.num_computed_tokens = 0
        self.status = Status.WAITING
        self.is_prefill_chunk = True
        self.num_preemptions = 0
        self.block_hashes: list[int] = []
        self.cached_tokens: int | None = None
        # Of cached_tokens, those a KV connector loads (PrefillStats.num_external_cached_tokens).
        self.external_cached_tokens = 0
        # The last step that scheduled it (a KV connector with async scheduling fences its
        # block frees by it).
        self.last_sched_seq = 0
        self.num_draft_tokens = 0  # drafts attached for the next step (len(spec_token_ids))
        self.num_drafts_proposed = 0
        self.num_drafts_accepted = 0
        self.num_verify_steps = 0
        self.accepted_trace = spec.accepted
        self.group_keys: dict[int, list[int]] = {}  # hybrid layouts: per-group block keys
        # Asynchronous scheduling: tokens scheduled whose outputs have not come back yet
        # (placeholders), tokens in flight, and in-flight tokens of a preempted request whose
        # outputs still arrive ("stale": delivered, but they change no counter).
        self.num_output_placeholders = 0
        self.num_in_flight_tokens = 0
        self.num_stale_output_tokens = 0
        self.drop_stale_output = False  # those outputs are dropped, not delivered
        # Hybrid lookups: where a longer single-group hit ended (0.32+ Mamba chunk stop).
        self.shared_prefix_boundary = 0
        self.join_step: int | None = None
        self.first_scheduled_step: int | None = None
        self.first_token_step: int | None = None
        self.finish_step: int | None = None
        self.first_scheduled_s: float | None = None  # when its first step started
        self.first_token_s: float | None = None
        self.finish_s: float | None = None
        self.session_id = spec.session_id
        self.warmup = spec.warmup
        self.replica: int | None = None  # a cluster's router sets it on arrival
        self.dp_rank: int | None = None  # and a replica's DP load balancer its rank
        # Running-list order: larger ranks were admitted later (the scheduler sets it).
        self.rank = 0
        # Lazy decode (kvsim.fastforward): None, or the step from which the counters above
        # lag the scheduled steps (and lz_upd: the applied outputs); see LazyDecode.
        self.lz_sched: int | None = None
        self.lz_upd = self.lz_in = 0
        # P/D: the params the request came with, and those its finish returned (the output's
        # kv_transfer_params, which the proxy hands the decode side).
        self.kv_transfer_params: KVTransferParams | None = None
        self.kv_transfer_output: KVTransferParams | None = None
        # P/D: the prefill instance the proxy sent it through, its hit there, and when its
        # prefill finished there (None: served by its decode instance alone).
        self.prefill_replica: int | None = None
        self.prefill_cached_tokens: int | None = None
        self.prefill_done_s: float | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus accepted output tokens (vLLM's ``request.num_tokens``)."""
        return self.num_prompt_tokens + self.num_output_tokens

    def token_window(self, start: int, end: int) -> tuple[int, ...]:
        """Token ids ``[start, end)`` of prompt + outputs."""
        p = self.num_prompt_tokens
        if end <= p:
            return self.prompt.window(start, end)
        if start >= p:
            return (self.output_token_id,) * (end - start)
        head = self.prompt.window(start, p) if start < p else ()
        return head + (self.output_token_id,) * (end - max(start, p))

    def block_contents(self, first: int, count: int, step: int, size: int) -> list | range:
        """``block_content`` of the token windows ``[first + k*step, + size)``, k < ``count``."""
        end = first + (count - 1) * step + size
        p = self.num_prompt_tokens
        if end <= p and type(self.prompt) is SegmentTokens:
            return self.prompt.block_contents(first, count, step, size)
        if first >= p:  # outputs only: every window is block_content((id,) * size)
            return [(self.output_token_id,) if size > 1 else self.output_token_id] * count
        tokens = self.token_window(first, end)
        return [block_content(tokens[k:k + size]) for k in range(0, count * step, step)]

    def __repr__(self) -> str:
        return (f"Request({self.req_id!r}, computed={self.num_computed_tokens}, "
                f"tokens={self.num_tokens}, {self.status.value})")
