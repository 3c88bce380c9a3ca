"""Named model and hardware presets, shipped under ``kvsim/presets/``.

A model preset is ``models/<name>.json``: a public Hugging Face ``config.json`` (under
``config``, as published) with its ``hf_id`` and ``source``; kvsim derives the model from it
as from any config.json (``kvsim.hf``). A hardware preset is ``hardware/<name>.toml`` with
spec-sheet numbers. ``kvsim/presets/SOURCES.md`` says where every file and number comes from.
"""

from __future__ import annotations

import json
import tomllib
from importlib import resources

_SUFFIX = {"models": ".json", "hardware": ".toml"}


def _dir(kind: str):
    return resources.files("kvsim") / "presets" / kind


def names(kind: str) -> list[str]:
    """Preset names of one kind (``models`` or ``hardware``), sorted."""
    suffix = _SUFFIX[kind]
    return sorted(p.name[:-len(suffix)] for p in _dir(kind).iterdir() if p.name.endswith(suffix))


def load(kind: str, name: str) -> dict | None:
    """The preset's table (a model's: ``name``, ``hf_id``, ``source``, ``config``, ...), or
    None if unknown. A model preset may also be named by its Hugging Face id."""
    if kind == "models":
        name = by_hf_id(name) or name
    path = _dir(kind) / f"{name}{_SUFFIX[kind]}"
    if "/" in name or not path.is_file():
        return None
    with path.open("rb") as f:
        return json.load(f) if kind == "models" else tomllib.load(f)


def hf_key(hf_id: str) -> str:
    """A Hugging Face id as compared across a base model and its ``-Instruct`` tune (same
    shapes): lower case, the suffix dropped."""
    return hf_id.lower().removesuffix("-instruct")


def by_hf_id(hf_id: str, ignore_instruct: bool = False) -> str | None:
    """The model preset for Hugging Face id ``hf_id`` (case-insensitive): its ``hf_id``, or one
    of ``also_hf_ids`` (checkpoints with the same config.json shapes), or None.
    ``ignore_instruct``: a base model and its ``-Instruct`` tune match (same shapes)."""
    if "/" not in hf_id:
        return None

    def key(s: str) -> str:
        return hf_key(s) if ignore_instruct else s.lower()
    for name in names("models"):
        with (_dir("models") / f"{name}.json").open("rb") as f:
            data = json.load(f)
        if key(hf_id) in (key(i) for i in [data.get("hf_id", ""), *data.get("also_hf_ids", [])]):
            return name
    return None
