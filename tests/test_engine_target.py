"""kvsim validate against the real vLLM CPU engine and server (opt-in: KVSIM_ENGINE_TESTS=1).

Needs the engine environment (kvsim/measure/make_engine_env.sh); CI's engine step builds it and
runs this file. Minutes, not seconds: never part of the default suite. The cached-token values
below are derived by hand from vLLM's prefix rules (block 32; a hit stops one token short of
the whole prompt; a wave scheduled in one step shares blocks, its first request reports 0),
independently of kvsim.
"""

import csv
import os
import socket
from pathlib import Path

import pytest

from kvsim.cli import main
from kvsim.measure import engine

pytestmark = pytest.mark.skipif(os.environ.get("KVSIM_ENGINE_TESTS") != "1",
                                reason="needs the vLLM engine environment (KVSIM_ENGINE_TESTS=1)")

SCENARIO = Path(__file__).parent.parent / "scenarios/validate/spaced_and_bursts.toml"
TINY_PROFILE = Path(__file__).parent / "fixtures/measure/tiny-profile.json"
SPACED = {"s0-prefix-cold": 0, "s1-prefix-hit": 512, "s2-repeat-s0": 544, "s3-partial-prefix": 288,
          "s4-short-cold": 0, "s5-extends-s1": 608, "s6-511-of-prefix": 480,
          "s7-one-block-prompt": 0, "s8-two-block-prompt": 32, "s9-warm-p2": 0,
          "s10-hit-p2": 256, "s11-chunked-cold": 0}


@pytest.fixture(scope="module", autouse=True)
def needs_environment():
    engine.engine_python(None)  # fails (not skips) when the flag is set but nothing was built


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes_with(text: str) -> list[str]:
    out = []
    for p in Path("/proc").iterdir():
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmd and "pytest" not in cmd:
            out.append(f"{p.name}: {cmd[:120]}")
    return out


def assert_no_server_left(port: int) -> None:
    assert processes_with(f"--port {port}") == []
    with socket.socket() as s:
        # Nobody listens there any more (the stopped server's connections may linger in
        # TIME_WAIT, which SO_REUSEADDR binds over but a listening socket would refuse).
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def measured(out: Path) -> dict[str, int]:
    with open(out / "requests.csv") as f:
        return {r["req_id"]: int(r["cached_tokens_measured"]) for r in csv.DictReader(f)}


def check_hand_derived(cached: dict[str, int]) -> None:
    assert {k: cached[k] for k in SPACED} == SPACED
    # A burst on the 256-token prefix s9 warmed: every request hits it.
    assert [v for k, v in cached.items() if k.startswith("w")] == [256] * 8


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("engine") / "out"
    rc = main(["validate", "--against", "vllm-engine", str(SCENARIO), "--out", str(out)])
    return rc, out


def test_engine_replay_hits_as_derived_by_hand(engine_run):
    rc, out = engine_run
    assert rc == 0
    cached = measured(out)
    check_hand_derived(cached)
    # A burst of 6 onto a prefix nobody warmed, scheduled in one step: 0 for the first, the
    # 320-token prefix for the five others.
    assert sorted(v for k, v in cached.items() if k.startswith("c")) == [0] + [320] * 5
    for f in ("requests.csv", "summary.json", "profile.json", "ttft_scatter.png", "cdf.png"):
        assert (out / f).is_file()


def test_eagle_drops_the_last_matched_block(tmp_path):
    # vLLM 0.32 protects an EAGLE hit by dropping its last matched block: one block (32 tokens)
    # less wherever there was a hit (none left of a one-block hit).
    out = tmp_path / "out"
    assert main(["validate", "--against", "vllm-engine",
                 str(SCENARIO.with_name("spec_eagle.toml")), "--out", str(out)]) == 0
    cached = measured(out)
    assert {k: cached[k] for k in SPACED} == {k: max(0, v - 32) for k, v in SPACED.items()}
    assert [v for k, v in cached.items() if k.startswith("w")] == [224] * 8


def test_server_replay(engine_run, tmp_path):
    _, eng = engine_run
    port = free_port()
    out = tmp_path / "out"
    rc = main(["validate", "--against", "vllm-server", str(SCENARIO), "--profile",
               str(eng / "profile.json"), "--port", str(port), "--out", str(out)])
    assert rc == 0
    check_hand_derived(measured(out))
    assert_no_server_left(port)


def scenario(tmp_path, text_edits=(), trace=None) -> Path:
    text = SCENARIO.read_text()
    text = text.replace('path = "traces/spaced_and_bursts.jsonl"',
                        f'path = "{trace or SCENARIO.parent / "traces/spaced_and_bursts.jsonl"}"')
    for old, new in text_edits:
        assert old in text
        text = text.replace(old, new)
    p = tmp_path / "s.toml"
    p.write_text(text)
    return p


def one_line(capsys, argv, *words) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kvsim: error: ") and all(w in err[-1] for w in words), err
    assert not any("Traceback" in line for line in err)


# vLLM refuses a max_model_len beyond the model's max_position_embeddings at start-up (kvsim
# allows it, as vLLM does with VLLM_ALLOW_LONG_MAX_MODEL_LEN).
TOO_LONG = [("max_model_len = 4096", "max_model_len = 8192")]


def test_server_that_fails_to_start(tmp_path, capsys):
    port = free_port()
    one_line(capsys, ["validate", "--against", "vllm-server", str(scenario(tmp_path, TOO_LONG)),
                      "--profile", str(TINY_PROFILE),
                      "--port", str(port), "--out", str(tmp_path / "out")],
             "exited during start-up")
    assert_no_server_left(port)
    assert not (tmp_path / "out").exists()


def test_engine_that_fails_to_start(tmp_path, capsys):
    one_line(capsys, ["validate", "--against", "vllm-engine", str(scenario(tmp_path, TOO_LONG)),
                      "--out", str(tmp_path / "out")], "vllm-engine", "max_model_len")
    assert not (tmp_path / "out").exists()


def test_server_request_that_errors(tmp_path, capsys):
    # A model with a smaller vocabulary than the trace's token ids: vLLM 0.32's server takes the
    # requests that carry larger ids (no tokenizer, no check) and its engine core fails on them
    # mid-stream (an InternalServerError chunk).
    profile = tmp_path / "p.json"
    profile.write_text(TINY_PROFILE.read_text().replace('"vocab_size": 32000', '"vocab_size": 20000'))
    port = free_port()
    one_line(capsys, ["validate", "--against", "vllm-server",
                      str(scenario(tmp_path, [("vocab_size = 32000", "vocab_size = 20000")])),
                      "--profile", str(profile), "--port", str(port), "--out", str(tmp_path / "out")],
             "request", "failed")
    assert_no_server_left(port)
    assert not (tmp_path / "out").exists()
