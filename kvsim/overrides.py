"""Dotted-key overrides, the one syntax kvsim takes them in: ``section.key=value[,value...]``.

Values are TOML literals (``true``, ``16``, ``0.9``, ``"fcfs"``, ``[0.8, 0.6]``); anything
that does not parse as one is taken as a bare string, so ``engine.scheduling_policy=priority``
works. Commas inside brackets or quotes do not split values.
"""

from __future__ import annotations

import copy
import tomllib

from kvsim.errors import ConfigError


def _split(text: str) -> list[str]:
    parts: list[str] = []
    cur: list[str] = []
    depth, quote = 0, None
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts]


def _value(text: str):
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse(spec: str) -> tuple[str, str, list]:
    """``"engine.block_size=16,32"`` -> ``("engine", "block_size", [16, 32])``. Raises ConfigError."""
    if "=" not in spec:
        raise ConfigError(spec, "an override is section.key=value[,value...]")
    key, _, values = spec.partition("=")
    section, dot, name = key.strip().partition(".")
    if not dot or not section or not name or "." in name:
        raise ConfigError(spec, "an override names one key as section.key")
    vals = [_value(v) for v in _split(values)]
    if not values.strip() or any(v == "" for v in vals):
        raise ConfigError(spec, "empty value")
    return section, name, vals


def apply(raw: dict, section: str, key: str, value) -> dict:
    """A copy of the scenario table with one key set (validation happens on loading)."""
    out = copy.deepcopy(raw)
    table = out.setdefault(section, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{section}.{key}", f"[{section}] is not a table")
    table[key] = value
    return out


def label(key: str, value) -> str:
    return f"{key}={str(value).lower() if isinstance(value, bool) else value}"
