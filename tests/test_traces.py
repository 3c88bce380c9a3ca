"""Trace readers (Mooncake, Azure), trace selection and the known-trace cache.

The public traces are not in the repository; tests that read them look in
``$KVSIM_SHARED_DATA`` (default ``../shared/data``; builders.SHARED_DATA), laid out as the trace cache:
``mooncake/conversation_trace.jsonl``, ``azure/AzureLLMInferenceTrace_code.csv``) and skip
when it is absent.
"""

import json
import urllib.error
from pathlib import Path

import pytest
from builders import SHARED_DATA

from kvsim import engine, metrics, traces
from kvsim.cli import main
from kvsim.config import parse_scenario
from kvsim.errors import ConfigError
from kvsim.workload import build_requests
from kvsim.workload.azure import read_azure
from kvsim.workload.mooncake import HASH_BLOCK, read_mooncake

DATA = SHARED_DATA
BASE = {"model": {"preset": "llama-3.1-8b"}, "hardware": {"preset": "h100-sxm"}}


def shared(rel: str) -> Path:
    p = DATA / rel
    if not p.is_file():
        pytest.skip(f"shared trace data absent: {p}")
    return p


def scenario(workload: dict, engine_keys: dict | None = None, run: dict | None = None):
    raw = {**BASE, "workload": {"kind": "trace", **workload}, "engine": engine_keys or {},
           "run": run or {}}
    return parse_scenario(raw)


def write(tmp_path, lines, name="t.jsonl"):
    p = tmp_path / name
    p.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return p


def mc(ts=0, n_in=600, n_out=4, ids=(1, 2)):
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": list(ids)}


# -- the published figures ---------------------------------------------------------------


@pytest.mark.parametrize("name, count, mean_in, mean_out", [
    # Mooncake FAST'25 Table 2 (and the release README): the files reproduce the figures.
    ("conversation", 12_031, 12_035, 343),
    ("synthetic", 3_993, 15_325, 149),
])
def test_mooncake_reproduces_published_counts_and_means(name, count, mean_in, mean_out):
    specs = read_mooncake(shared(f"mooncake/{name}_trace.jsonl"))
    assert len(specs) == count
    assert round(sum(len(s.prompt) for s in specs) / count) == mean_in
    assert round(sum(s.max_tokens for s in specs) / count) == mean_out


@pytest.mark.parametrize("name, count, mean_in, mean_out, span_s", [
    # The 2023 files as shipped (no published table to compare with): rows, mean context and
    # generated tokens, first-to-last arrival.
    ("code", 8_819, 2048, 28, 3435.95),
    ("conv", 19_366, 1155, 211, 3501.72),
])
def test_azure_rows_become_requests_with_unique_prompts(name, count, mean_in, mean_out, span_s):
    specs = read_azure(shared(f"azure/AzureLLMInferenceTrace_{name}.csv"))
    assert len(specs) == count
    assert round(sum(len(s.prompt) for s in specs) / count) == mean_in
    assert round(sum(s.max_tokens for s in specs) / count) == mean_out
    assert specs[0].arrival_s == 0 and specs[-1].arrival_s == pytest.approx(span_s, abs=0.01)
    # Disjoint token runs: no two prompts share a token, so nothing is falsely shared.
    runs = sorted((s.prompt.firsts[0], len(s.prompt)) for s in specs)
    assert all(a + n <= b for (a, n), (b, _) in zip(runs, runs[1:]))


# -- prefix hits equal the hash ids' own sharing -----------------------------------------


def direct_hits(rows: list[dict], block_size: int) -> tuple[int, int]:
    """Prefix-cache hits and queries, in tokens, computed from the hash ids alone.

    An unbounded cache that holds every earlier prompt: a request matches hash block j when
    an earlier request had the same first j + 1 hash ids (Mooncake ids are prefix hashes, but
    the whole prefix is compared anyway), up to the shorter of the two blocks (a partial last
    block). The hit is that many tokens, capped at the prompt length - 1 as vLLM caps it, in
    whole blocks of ``block_size``.
    """
    seen: dict[tuple, int] = {}
    hits = queries = 0
    for r in rows:
        ids, n = r["hash_ids"], r["input_length"]
        lengths = [min(HASH_BLOCK, n - HASH_BLOCK * j) for j in range(len(ids))]
        matched = 0
        for j, length in enumerate(lengths):
            got = seen.get(tuple(ids[: j + 1]), 0)
            matched += min(got, length)
            if got < length:
                break
        hits += min(matched, n - 1) // block_size * block_size
        queries += n
        for j, length in enumerate(lengths):
            key = tuple(ids[: j + 1])
            seen[key] = max(seen.get(key, 0), length)
    return hits, queries


@pytest.mark.parametrize("name, block_size, n", [
    ("conversation", 16, 400),     # divides 512: whole hash blocks are hit
    ("conversation", 1024, 400),   # does not: hits round down to whole 1024-token blocks
    ("synthetic", 96, 400),        # nor does this; blocks straddle hash blocks
])
def test_mooncake_hit_ratio_equals_the_hash_ids_ratio(name, block_size, n):
    path = shared(f"mooncake/{name}_trace.jsonl")
    with open(path) as f:
        rows = [json.loads(line) for _, line in zip(range(n), f)]
    want_hits, want_queries = direct_hits(rows, block_size)
    # Unbounded cache, no eviction: a pool holding every block of every request; a token
    # budget that schedules each prompt whole in the step that admits it, so a request's
    # lookup sees every earlier prompt (blocks are published when scheduled).
    pool = sum(-(-(r["input_length"] + r["output_length"]) // block_size) for r in rows) + 1
    sc = scenario({"format": "mooncake", "path": str(path), "speedup": 100.0},
                  {"block_size": block_size, "num_gpu_blocks": pool,
                   "max_num_batched_tokens": 1 << 24, "max_model_len": 200_000},
                  {"max_requests": n})
    rec = engine.run(sc, build_requests(sc))
    summary = metrics.summarize(sc, rec)
    assert summary["num_finished"] == n and summary["num_preemptions"] == 0
    assert (summary["prefix_cache_hits"], summary["prefix_cache_queries"]) == (want_hits, want_queries)
    assert want_hits > 0.04 * want_queries  # the first requests already share prefixes


# -- the expansion rule ------------------------------------------------------------------


def test_equal_hash_ids_give_equal_blocks_and_tail_is_cut(tmp_path):
    p = write(tmp_path, [mc(n_in=1100, ids=(7, 8, 9)), mc(n_in=700, ids=(7, 8)), mc(n_in=512, ids=(3,))])
    a, b, c = read_mooncake(p)
    assert (len(a.prompt), len(b.prompt), len(c.prompt)) == (1100, 700, 512)
    assert a.prompt.window(0, 700) == b.prompt.window(0, 700)  # same ids, same tokens
    assert a.prompt.window(1024, 1100) == tuple(range(9 * HASH_BLOCK, 9 * HASH_BLOCK + 76))
    # Different ids never share a token at any offset.
    assert not set(c.prompt.window(0, 512)) & set(a.prompt.window(0, 1100))


# -- malformed traces --------------------------------------------------------------------


@pytest.mark.parametrize("line, what", [
    ("{not json", "not valid JSON"),
    ({"timestamp": 0, "input_length": 600, "output_length": 4}, "missing field 'hash_ids'"),
    ({"input_length": 600, "output_length": 4, "hash_ids": [1, 2]}, "missing field 'timestamp'"),
    (mc(n_in=-5), "input_length must be an integer >= 1"),
    (mc(n_out=-1), "output_length must be an integer >= 1"),
    (mc(ts=-3), "timestamp"),
    (mc(n_in=600, ids=(1, 2, 3)), "3 hash_ids for input_length 600: more than the 2 blocks"),
    (mc(n_in=1200, ids=(1, 2)), "fewer than the 3 blocks"),
    (mc(ids=(1, "x")), "hash_ids must be a list of non-negative integers"),
    ([1, 2], "JSON object"),
])
def test_bad_mooncake_line_is_reported_with_its_number(tmp_path, line, what):
    p = write(tmp_path, [mc(), "", line])
    with pytest.raises(ConfigError) as exc:
        read_mooncake(p)
    assert exc.value.where == f"{p}:3"
    assert what in exc.value.what


@pytest.mark.parametrize("row, what", [
    ("2023-11-16 18:17:04.03,-3,8", "ContextTokens must be >= 1"),
    ("2023-11-16 18:17:04.03,3180", "expected 3 fields"),
    ("yesterday,3180,8", "TIMESTAMP"),
    ("2023-11-16 18:17:04.03,many,8", "ContextTokens must be an integer"),
])
def test_bad_azure_row_is_reported_with_its_line(tmp_path, row, what):
    p = tmp_path / "a.csv"
    p.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97996,4808,10\n{row}\n")
    with pytest.raises(ConfigError) as exc:
        read_azure(p)
    assert exc.value.where == f"{p}:3"
    assert what in exc.value.what


@pytest.mark.parametrize("fmt, text", [
    ("mooncake", ""), ("mooncake", "\n\n"), ("azure", ""),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n"), ("kvsim", "\n"),
])
def test_empty_trace_is_an_error(tmp_path, capsys, fmt, text):
    p = tmp_path / "t.trace"
    p.write_text(text)
    s = tmp_path / "s.toml"
    s.write_text(f'[model]\npreset = "llama-3.2-1b"\n[hardware]\npreset = "l40s"\n'
                 f'[workload]\nkind = "trace"\nformat = "{fmt}"\npath = "t.trace"\n')
    assert main(["run", str(s), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == f"kvsim: error: {p}: the trace holds no requests\n"
    assert not (tmp_path / "out").exists()


def test_bad_line_through_the_cli_is_one_line(tmp_path, capsys):
    p = write(tmp_path, [mc(), mc(n_in=600, ids=(1, 2, 3))])
    s = tmp_path / "s.toml"
    s.write_text(f'[model]\npreset = "llama-3.2-1b"\n[hardware]\npreset = "l40s"\n'
                 f'[workload]\nkind = "trace"\nformat = "mooncake"\npath = "{p}"\n')
    assert main(["run", str(s), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"kvsim: error: {p}:2: 3 hash_ids")


# -- window, sampling, speedup, limit ----------------------------------------------------


def test_window_speedup_sample_and_limit(tmp_path):
    p = write(tmp_path, [mc(ts=1000 * t, ids=(t, 100 + t)) for t in range(10)])
    ids = lambda sc: [s.req_id for s in build_requests(sc)]  # noqa: E731
    arrivals = lambda sc: [s.arrival_s for s in build_requests(sc)]  # noqa: E731
    w = {"format": "mooncake", "path": str(p)}
    assert arrivals(scenario(w)) == [float(t) for t in range(10)]
    win = scenario({**w, "window_start_s": 3, "window_end_s": 7, "speedup": 2.0})
    assert ids(win) == ["mc3", "mc4", "mc5", "mc6"] and arrivals(win) == [0.0, 0.5, 1.0, 1.5]
    assert ids(scenario(w, run={"max_requests": 3})) == ["mc0", "mc1", "mc2"]
    half = scenario({**w, "sample_fraction": 0.5}, run={"seed": 3})
    picked = ids(half)
    assert len(picked) == 5 and picked == sorted(picked, key=lambda i: int(i.removeprefix("mc")))
    assert ids(scenario({**w, "sample_fraction": 0.5}, run={"seed": 3})) == picked
    others = {tuple(ids(scenario({**w, "sample_fraction": 0.5}, run={"seed": s}))) for s in range(8)}
    assert len(others) > 1
    with pytest.raises(ConfigError, match="no request arrives in the window"):
        build_requests(scenario({**w, "window_start_s": 50}))
    with pytest.raises(ConfigError, match="must be greater than window_start_s"):
        scenario({**w, "window_start_s": 5, "window_end_s": 5})


# -- the known traces and the cache ------------------------------------------------------


def test_named_trace_resolves_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_TRACE_DIR", str(tmp_path))
    with pytest.raises(ConfigError) as exc:
        scenario({"trace": "mooncake-conversation"})
    assert exc.value.where == "scenario: workload.trace"
    assert str(tmp_path / "mooncake" / "conversation_trace.jsonl") in exc.value.what
    assert "kvsim traces download mooncake-conversation" in exc.value.what
    (tmp_path / "mooncake").mkdir()
    write(tmp_path / "mooncake", [mc()], "conversation_trace.jsonl")
    w = scenario({"trace": "mooncake-conversation"}).workload
    assert (w.format, w.path) == ("mooncake", tmp_path / "mooncake" / "conversation_trace.jsonl")
    with pytest.raises(ConfigError, match="did you mean 'mooncake-conversation'"):
        scenario({"trace": "mooncake-conversaton"})
    with pytest.raises(ConfigError, match="in format 'mooncake', not 'azure'"):
        scenario({"trace": "mooncake-conversation", "format": "azure"})


def test_cache_dir_defaults(monkeypatch, tmp_path):
    monkeypatch.delenv("KVSIM_TRACE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert traces.cache_dir() == tmp_path / "kvsim" / "traces"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert traces.cache_dir() == Path.home() / ".cache" / "kvsim" / "traces"


def test_traces_listing(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("KVSIM_TRACE_DIR", str(tmp_path))
    assert main(["traces"]) == 0
    out = capsys.readouterr().out
    for t in traces.KNOWN.values():
        assert t.name in out and t.url in out
    assert "3.0 MB" in out and "Apache-2.0" in out and "CC-BY-4.0" in out
    assert str(tmp_path) in out


def test_download_failure_is_one_line_and_leaves_nothing(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("KVSIM_TRACE_DIR", str(tmp_path))

    def offline(*args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(traces.urllib.request, "urlopen", offline)
    assert main(["traces", "download", "azure-code-2023"]) == 2
    err = capsys.readouterr().err
    assert err == ("kvsim: error: traces download azure-code-2023: cannot download "
                   f"{traces.KNOWN['azure-code-2023'].url}: [Errno -3] Temporary failure in name "
                   "resolution\n")
    assert not list(tmp_path.iterdir())  # no file, and no empty folder it made either
    assert main(["traces", "download", "no-such-trace"]) == 2
    assert "unknown trace 'no-such-trace'" in capsys.readouterr().err


def test_download_checks_the_checksum(monkeypatch, tmp_path):
    class Resp:
        def __init__(self, data):
            self.data = [data]

        def read(self, n):
            return self.data.pop() if self.data else b""

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    monkeypatch.setattr(traces.urllib.request, "urlopen", lambda *a, **k: Resp(b"not the trace"))
    with pytest.raises(ConfigError, match="checksum mismatch"):
        traces.download("mooncake-synthetic", tmp_path)
    assert not any(p.is_file() for p in tmp_path.rglob("*"))
    # A trace without a recorded checksum is saved as it comes.
    path = traces.download("mooncake-toolagent", tmp_path)
    assert path == tmp_path / "mooncake" / "toolagent_trace.jsonl"
    assert path.read_bytes() == b"not the trace"


def test_shared_folder_serves_as_the_cache(monkeypatch):
    shared("mooncake/conversation_trace.jsonl")
    monkeypatch.setenv("KVSIM_TRACE_DIR", str(DATA))
    sc = scenario({"trace": "mooncake-conversation", "window_end_s": 20})
    specs = build_requests(sc)
    assert specs and all(s.arrival_s < 20 for s in specs)


def test_azure_header_with_byte_order_mark(tmp_path):
    p = tmp_path / "a.csv"
    p.write_bytes(b"\xef\xbb\xbfTIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,48,10\n"
                  b"2023-11-16 18:17:04.2199600,30,8\n")
    a, b = read_azure(p)
    assert (len(a.prompt), a.max_tokens, b.arrival_s) == (48, 10, pytest.approx(0.24996))
    assert not set(a.prompt.window(0, 48)) & set(b.prompt.window(0, 30))
