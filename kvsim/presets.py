"""Named model and hardware presets, shipped as TOML under ``kvsim/presets/``.

Each file carries public spec-sheet or ``config.json`` numbers; ``kvsim/presets/SOURCES.md``
says where every number comes from.
"""

from __future__ import annotations

import tomllib
from importlib import resources


def _dir(kind: str):
    return resources.files("kvsim") / "presets" / kind


def names(kind: str) -> list[str]:
    """Preset names of one kind (``models`` or ``hardware``), sorted."""
    return sorted(p.name[:-5] for p in _dir(kind).iterdir() if p.name.endswith(".toml"))


def load(kind: str, name: str) -> dict | None:
    """The preset's key/value table (``source`` and ``name`` included), or None if unknown."""
    path = _dir(kind) / f"{name}.toml"
    if not path.is_file():
        return None
    with path.open("rb") as f:
        return tomllib.load(f)
