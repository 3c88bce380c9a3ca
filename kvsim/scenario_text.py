"""Scenarios as text: the resolved scenario kvsim writes beside every run (TOML that loads
back to the same scenario) and the key tables of ``docs/scenario.md``, both from ``SCHEMA``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kvsim.schema import (
    DEPLOYMENT_REPLICAS,
    ENGINE_KEYS,
    GROUP_KEYS,
    OFFLOAD_EXTRA_KEYS,
    PD_CLUSTER_KEYS,
    REQUIRED,
    SCHEMA,
    SHARED_ENGINE_KEYS,
    TRACE_ONLY_KEYS,
    Key,
    Scenario,
)


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, tuple | list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, Path):
        v = str(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, dict):  # an inline table
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {v!r} as TOML")


def resolved_toml(sc: Scenario) -> str:
    """Every key with the value the run used (presets expanded, defaults filled in).

    Loading this text again gives the same scenario (trace paths are absolute).
    """
    lines = ["# Resolved by kvsim: every key with the value this run used.", ""]
    for section in SCHEMA:
        cfg = getattr(sc, section)
        if cfg is None:
            continue  # no [cluster]
        lines.append(f"[{section}]")
        for key in SCHEMA[section]:
            if not hasattr(cfg, key.name):
                continue
            v = getattr(cfg, key.name)
            if v is None or (section == "model" and key.name in ("preset", "config") and not v):
                continue
            if section == "workload" and (key.name == "trace" or (
                    key.name in TRACE_ONLY_KEYS and not sc.workload.reads_trace)):
                continue  # a named trace is written as its resolved path
            if section == "speculative" and key.name != "method" and not sc.speculative.enabled:
                continue
            if ((section == "cluster" and key.name in PD_CLUSTER_KEYS and sc.cluster is not None
                 and not sc.cluster.disaggregated)
                    or (section == "engine" and key.name == "kv_role" and v == "kv_both")):
                continue  # P/D settings, taken only with prefill and decode instances
            if key.type in ("groups", "deployments") or (
                    section == "cluster" and key.name == "replicas" and sc.cluster is not None
                    and sc.cluster.deployment):
                continue  # written as [[engine.kv_groups]] / [[cluster.deployment]] tables below
            lines.append(f"{key.name} = {toml_value(v)}")
        lines.append("")
        if section == "engine" and sc.engine.kv_groups:
            for g in sc.engine.kv_groups:
                lines.append("[[engine.kv_groups]]")
                for k in GROUP_KEYS:
                    v = getattr(g, k.name)
                    if v is not None and not (k.name == "sliding_window" and g.kind != "sliding_window"):
                        lines.append(f"{k.name} = {toml_value(v)}")
                lines.append("")
        if section == "cluster" and sc.cluster is not None and sc.cluster.deployment:
            first = 0
            for n, _ in sc.cluster.deployment:
                # The deployment's engine values that differ from [engine], as resolved.
                e = sc.cluster.engines[first]
                first += n
                lines += ["[[cluster.deployment]]", f"replicas = {n}"]
                for k in ENGINE_KEYS:
                    v = getattr(e, k.name)
                    if k.name not in SHARED_ENGINE_KEYS and v != getattr(sc.engine, k.name):
                        lines.append(f"{k.name} = {toml_value(v)}")
                lines.append("")
    return "\n".join(lines)


def schema_markdown() -> str:
    """The key tables of docs/scenario.md, generated from ``SCHEMA`` (a test keeps them in sync)."""
    out = []
    for section, keys in SCHEMA.items():
        out += [f"### [{section}]", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for k in keys:
            if k.default is REQUIRED:
                default = "required"
            elif k.default is None:
                default = "derived" if k.derived else "none"
            else:
                default = f"`{toml_value(k.default)}`"
            kind = k.type + (" (" + ", ".join(f"`{c}`" for c in k.choices) + ")" if k.choices else "")
            out.append(f"| `{k.name}` | {kind} | {default} | {k.doc} |")
        out.append("")
        subs: dict[str, list[tuple[str, tuple[Key, ...]]]] = {
            "engine": [("[[engine.kv_groups]]", GROUP_KEYS),
                       ("engine.kv_connector_extra_config", OFFLOAD_EXTRA_KEYS)],
            "cluster": [("[[cluster.deployment]]", (DEPLOYMENT_REPLICAS,))]}
        for sub in subs.get(section, []):
            out += [f"#### {sub[0]}", "", "| key | type | default | meaning |",
                    "|---|---|---|---|"]
            for k in sub[1]:
                default = "required" if k.default is REQUIRED else (
                    "none" if k.default is None else f"`{toml_value(k.default)}`")
                kind = k.type + (" (" + ", ".join(f"`{c}`" for c in k.choices) + ")" if k.choices else "")
                out.append(f"| `{k.name}` | {kind} | {default} | {k.doc} |")
            if sub[0] == "[[cluster.deployment]]":
                out.append("| any `[engine]` key | as in `[engine]` | the `[engine]` value | This "
                           "deployment's value, except for the keys every replica shares: "
                           + ", ".join(f"`{k}`" for k in SHARED_ENGINE_KEYS) + ". |")
            out.append("")
    return "\n".join(out)


def write_key_tables(doc: Path) -> None:
    """Replace the key tables in ``doc`` (docs/scenario.md) with ``schema_markdown()``: from
    its ``### [model]`` heading to the end of the last table."""
    text = doc.read_text(encoding="utf-8")
    start = text.index("### [model]")
    end = text.index("\n\n## ", start) + 1
    doc.write_text(text[:start] + schema_markdown() + text[end:], encoding="utf-8")


if __name__ == "__main__":  # python -m kvsim.scenario_text docs/scenario.md
    import sys

    write_key_tables(Path(sys.argv[1]))
