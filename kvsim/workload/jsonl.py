"""The kvsim JSONL trace format: one request per line.

    {"arrival_s": 0.5, "max_tokens": 64, "prompt_token_ids": [1, 2, 3]}
    {"arrival_s": 0.7, "max_tokens": 64, "prompt_segments": [[1, 3], [900, 40]],
     "req_id": "user7-turn2", "priority": 0, "accepted": [2, 0, 3], "session_id": "user7"}

``prompt_segments`` lists ``[first_token_id, length]`` runs whose concatenation is the prompt,
so long shared prefixes cost a few numbers. Token ids are any non-negative integers.
``session_id`` (a string or an integer) names the conversation or user a request belongs to
(a cluster's ``session_affinity`` router keeps a session on one replica).
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import TypeGuard

from kvsim.errors import ConfigError
from kvsim.request import ExplicitTokens, RequestSpec, SegmentTokens

FIELDS = ("arrival_s", "max_tokens", "prompt_token_ids", "prompt_segments", "req_id", "priority",
          "accepted", "session_id")


def _int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_line(obj, where: str, index: int) -> RequestSpec:
    if not isinstance(obj, dict):
        raise ConfigError(where, "each line must be a JSON object")
    for k in obj:
        if k not in FIELDS:
            close = difflib.get_close_matches(k, FIELDS, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(where, f"unknown field '{k}'{hint}")
    arrival = obj.get("arrival_s")
    if isinstance(arrival, bool) or not isinstance(arrival, int | float) or not arrival >= 0 \
            or arrival == float("inf"):
        raise ConfigError(where, f"arrival_s must be a finite number >= 0, got {arrival!r}")
    max_tokens = obj.get("max_tokens")
    if not _int(max_tokens) or max_tokens < 1:
        raise ConfigError(where, f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    priority = obj.get("priority", 0)
    if not _int(priority):
        raise ConfigError(where, f"priority must be an integer, got {priority!r}")
    req_id = obj.get("req_id", f"r{index}")
    if isinstance(req_id, bool) or not isinstance(req_id, str | int):
        raise ConfigError(where, f"req_id must be a string or an integer, got {req_id!r}")
    session = obj.get("session_id")
    if session is not None and (isinstance(session, bool) or not isinstance(session, str | int)):
        raise ConfigError(where, f"session_id must be a string or an integer, got {session!r}")
    accepted = obj.get("accepted")
    if accepted is not None and (not isinstance(accepted, list) or not accepted
                                 or not all(_int(a) and a >= 0 for a in accepted)):
        raise ConfigError(where, "accepted must be a non-empty list of non-negative integers "
                          "(drafts accepted at each verify step)")
    ids, segs = obj.get("prompt_token_ids"), obj.get("prompt_segments")
    if (ids is None) == (segs is None):
        raise ConfigError(where, "give exactly one of prompt_token_ids and prompt_segments")
    if ids is not None:
        if not isinstance(ids, list) or not ids:
            raise ConfigError(where, "prompt_token_ids must be a non-empty list")
        if not all(_int(t) and t >= 0 for t in ids):
            raise ConfigError(where, "prompt_token_ids must hold non-negative integers")
        prompt: ExplicitTokens | SegmentTokens = ExplicitTokens(tuple(ids))
    else:
        if not isinstance(segs, list) or not segs:
            raise ConfigError(where, "prompt_segments must be a non-empty list of [first_token_id, length]")
        for seg in segs:
            if (not isinstance(seg, list) or len(seg) != 2 or not all(_int(x) for x in seg)
                    or seg[0] < 0 or seg[1] < 1):
                raise ConfigError(where, f"prompt_segments entry {seg!r} must be [first_token_id >= 0, "
                                  "length >= 1]")
        prompt = SegmentTokens([(f, n) for f, n in segs])
    return RequestSpec(req_id=str(req_id), arrival_s=float(arrival), prompt=prompt,
                       max_tokens=max_tokens, priority=priority,
                       accepted=tuple(accepted) if accepted else None,
                       session_id=None if session is None else str(session))


def json_lines(path: Path):
    """Yield ``(where, object)`` for each non-blank line of a JSONL file, ``where`` being
    ``file:line``. Raises ConfigError naming the file (and line) on unreadable input."""
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConfigError(where, f"not valid JSON: {exc.msg}") from None
                yield where, obj
    except OSError as exc:
        raise ConfigError(str(path), exc.strerror or str(exc)) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), f"not UTF-8 text: {exc.reason}") from None


def read_kvsim_jsonl(path: Path) -> list[RequestSpec]:
    """Read a kvsim JSONL trace. Raises ConfigError naming the file and line."""
    specs: list[RequestSpec] = []
    seen: dict[str, str] = {}
    for where, obj in json_lines(path):
        spec = _parse_line(obj, where, len(specs))
        if spec.req_id in seen:
            raise ConfigError(where, f"req_id {spec.req_id!r} repeats line {seen[spec.req_id]}")
        seen[spec.req_id] = where.rsplit(":", 1)[1]
        specs.append(spec)
    if not specs:
        raise ConfigError(str(path), "the trace holds no requests")
    return specs
