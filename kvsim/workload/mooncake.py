"""Mooncake traces (kvcache-ai/Mooncake, FAST'25 release): one JSON object per line.

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

``timestamp`` is the arrival in milliseconds, ``hash_ids`` the remapped hashes of the prompt's
512-token blocks (equal ids, equal prefixes). Prompts carry no text, so kvsim expands the ids
to token ids deterministically:

    token at position p  =  HASH_BLOCK * hash_ids[p // 512]  +  p % 512

The last hash block is cut to ``input_length``. The rule is injective per (hash id, offset),
so two prompts share a token exactly where they share a hash block, at the same offset.
With a ``block_size`` that divides 512 every kvsim block lies inside one hash block: equal
hash ids give equal blocks and a hit covers whole hash blocks (plus the full kvsim blocks
of a shared partial tail). With any other ``block_size`` a kvsim block can straddle two hash
blocks and is equal only when both are: the hit is the shared prefix rounded down to a
multiple of ``block_size``, never more.
"""

from __future__ import annotations

from pathlib import Path

from kvsim.errors import ConfigError
from kvsim.request import RequestSpec, SegmentTokens
from kvsim.workload.jsonl import json_lines

HASH_BLOCK = 512  # tokens per Mooncake hash id
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def mooncake_prompt(hash_ids: list[int], input_length: int) -> SegmentTokens:
    """The prompt of ``input_length`` tokens that ``hash_ids`` describe (see the module doc)."""
    segs = []
    left = input_length
    for h in hash_ids:
        n = min(HASH_BLOCK, left)
        segs.append((h * HASH_BLOCK, n))
        left -= n
    return SegmentTokens(segs)


def _parse(obj, where: str, index: int) -> RequestSpec:
    if not isinstance(obj, dict):
        raise ConfigError(where, "each line must be a JSON object")
    for k in FIELDS:
        if k not in obj:
            raise ConfigError(where, f"missing field '{k}' (a Mooncake line has {', '.join(FIELDS)})")
    ts, n_in, n_out, ids = (obj[k] for k in FIELDS)
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not 0 <= ts < float("inf"):
        raise ConfigError(where, f"timestamp must be a finite number of milliseconds >= 0, got {ts!r}")
    if not _int(n_in) or n_in < 1:
        raise ConfigError(where, f"input_length must be an integer >= 1, got {n_in!r}")
    if not _int(n_out) or n_out < 1:
        raise ConfigError(where, f"output_length must be an integer >= 1, got {n_out!r}")
    if not isinstance(ids, list) or not all(_int(h) and h >= 0 for h in ids):
        raise ConfigError(where, "hash_ids must be a list of non-negative integers")
    need = -(-n_in // HASH_BLOCK)
    if len(ids) != need:
        more = "more" if len(ids) > need else "fewer"
        raise ConfigError(where, f"{len(ids)} hash_ids for input_length {n_in}: {more} than the "
                          f"{need} blocks of {HASH_BLOCK} tokens it needs")
    return RequestSpec(req_id=f"mc{index}", arrival_s=ts / 1000.0,
                       prompt=mooncake_prompt(ids, n_in), max_tokens=n_out)


def read_mooncake(path: Path) -> list[RequestSpec]:
    """Read a Mooncake JSONL trace. Raises ConfigError naming the file and line.

    Request ids are the 0-based line index among non-blank lines; fields other than the
    four above are ignored.
    """
    specs: list[RequestSpec] = []
    for where, obj in json_lines(path):
        specs.append(_parse(obj, where, len(specs)))
    if not specs:
        raise ConfigError(str(path), "the trace holds no requests")
    return specs
