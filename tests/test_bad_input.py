"""Any scenario file, however wrong, gives a run or one line: a property test.

Scenario files are made by mutating a valid one: keys set, removed or misspelt in known and
unknown sections, values of every TOML type and size (huge, negative, NaN, empty, nested), and
bytes of the file itself replaced. ``kvsim run`` must then either succeed, leaving its result
folder, or exit 2 with exactly one ``kvsim: error:`` line and no folder. Each run is held to a
few steps (``[run]`` limits set after the mutations), so a valid file costs milliseconds.

The default suite draws ``KVSIM_BAD_INPUT_EXAMPLES`` cases (1,000); CI runs 10,000 more.
"""

import contextlib
import io
import math
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsim.cli import main
from kvsim.scenario_text import toml_value
from kvsim.schema import MAX_REQUESTS, SCHEMA

BASE = {
    "model": {"preset": "llama-3.2-1b"},
    "hardware": {"preset": "l40s"},
    "engine": {"num_gpu_blocks": 400, "max_model_len": 2048, "max_num_batched_tokens": 512,
               "max_num_seqs": 16},
    "workload": {"num_requests": 8, "request_rate": 20.0, "system_prompt_tokens": 128,
                 "user_history_tokens": 64, "input_tokens": 32, "output_tokens": 16},
}
SECTIONS = [*SCHEMA, "speculative_config", "Engine", "x"]
KEYS = sorted({k.name for keys in SCHEMA.values() for k in keys}
              | {"kind", "block_size", "sliding_window", "eagle", "data_parallel_size", "model", ""})

scalars = st.one_of(
    st.booleans(),
    st.integers(-3, 70000),
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from([0, 1, 2, 3, 16, 17, 64, 2**31, 10**12]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 0.5, 1.0, 1e-300, 1e300]),
    st.text(max_size=12),
    st.sampled_from(["auto", "fp8", "mtp", "eagle3", "ngram", "trace", "synthetic", "none",
                     "dense", "align", "h200", "deepseek-v3", "qwen3.5-27b", "mooncake",
                     "0.19.0", "0.33.0", "9.0", "/dev/null", "."]),
)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(KEYS), inner, max_size=3)),
    max_leaves=6)


def toml_text(v) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f'"{k}" = {toml_text(x)}' for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(toml_text(x) for x in v) + "]"
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return toml_value(v)


def scenario_text(raw: dict) -> str:
    lines = []
    for section, table in raw.items():
        if not isinstance(table, dict):
            lines.insert(0, f'"{section}" = {toml_text(table)}')
            continue
        lines.append(f'["{section}"]')
        lines += [f'"{k}" = {toml_text(v)}' for k, v in table.items()]
    return "\n".join(lines) + "\n"


KEY_OF = {(section, k.name): k for section, keys in SCHEMA.items() for k in keys}


@st.composite
def typed(draw, key):
    """A value of the key's own type, near its bounds and choices (most such files parse, so
    the run itself is exercised)."""
    if key.choices:
        return draw(st.sampled_from(key.choices))
    if key.type == "bool":
        return draw(st.booleans())
    lo = key.low if key.low is not None else -10
    hi = key.high if key.high is not None else 10**7
    if key.type == "int":
        return draw(st.one_of(st.integers(int(lo), int(min(hi, lo + 5000))),
                              st.sampled_from([int(lo), int(hi), int(hi) + 1, int(lo) - 1])))
    if key.type in ("float", "floats"):
        x = draw(st.one_of(st.floats(float(lo), float(min(hi, lo + 100))),
                           st.sampled_from([float(lo), float(hi)])))
        return [x] * draw(st.integers(1, 3)) if key.type == "floats" else x
    return draw(values)


@st.composite
def scenarios(draw) -> bytes:
    raw = {s: dict(t) for s, t in BASE.items()}
    for _ in range(draw(st.integers(1, 4))):
        section = draw(st.sampled_from(list(SCHEMA)) if draw(st.integers(0, 9)) else
                       st.sampled_from(SECTIONS))
        op = draw(st.sampled_from(["set"] * 16 + ["drop", "drop", "replace", "unset"]))
        if op == "drop":
            raw.pop(section, None)
        elif op == "replace":
            raw[section] = draw(values)
        elif op == "unset" and isinstance(raw.get(section), dict) and raw[section]:
            raw[section].pop(draw(st.sampled_from(sorted(raw[section]))))
        else:
            table = raw.setdefault(section, {})
            if isinstance(table, dict):
                own = [k for (sec, k) in KEY_OF if sec == section]
                name = draw(st.sampled_from(own) if own and draw(st.integers(0, 4)) else
                            st.sampled_from(KEYS))
                key = KEY_OF.get((section, name))
                table[name] = draw(typed(key)) if key and draw(st.integers(0, 3)) else draw(values)
    # Bounded runs: a valid file must finish in a few steps (and a workload within its bound
    # but of a million requests, seconds to make, is made smaller: the bound has its own test).
    workload = raw.get("workload")
    for key in ("num_requests", "num_documents"):
        if isinstance(workload, dict) and type(workload.get(key)) is int and (
                20000 < workload[key] <= MAX_REQUESTS):
            workload[key] = 20000
    run = raw.get("run") if isinstance(raw.get("run"), dict) else {}
    raw["run"] = {**run, "max_steps": 30, "max_sim_time_s": 5.0}
    text = scenario_text(raw).encode()
    if draw(st.integers(0, 19)) == 0:  # bytes of the file replaced
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.binary(min_size=1, max_size=8)) + text[at + 1:]
    return text


@settings(max_examples=int(os.environ.get("KVSIM_BAD_INPUT_EXAMPLES", "1000")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(text=scenarios())
def test_any_scenario_runs_or_is_one_line(tmp_path, text):
    path, out = tmp_path / "s.toml", tmp_path / "out"
    path.write_bytes(text)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["run", str(path), "--out", str(out), "--force", "-q"])
    message = err.getvalue()
    if code == 0:
        assert (out / "summary.json").is_file(), message
    else:
        assert code == 2, message
        assert message.startswith("kvsim: error: ") and message.count("\n") == 1, message
        assert not out.exists() or (out / "summary.json").is_file()  # an earlier case's result
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]
