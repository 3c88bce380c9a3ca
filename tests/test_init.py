"""kvsim init: a scenario from a vllm serve command line."""

import tomllib

import pytest

from kvsim.cli import main
from kvsim.config import load_scenario


def _init(capsys, tmp_path, *words, hardware="h100-sxm"):
    out = tmp_path / "s.toml"
    code = main(["init", "--hardware", hardware, "--out", str(out), "--", *words])
    return code, out, capsys.readouterr().err.strip().splitlines()


def test_the_issues_example_runs_with_every_flag(tmp_path, capsys):
    code, out, err = _init(capsys, tmp_path, "vllm", "serve", "Qwen/Qwen3-32B", "-tp", "2",
                           "--max-num-batched-tokens", "4096", "--max-num-seqs", "64",
                           "--max-model-len", "32K", "--block-size", "32",
                           "--gpu-memory-utilization", "0.85", "--kv-cache-dtype", "fp8",
                           "--no-enable-prefix-caching", "--async-scheduling",
                           "--long-prefill-token-threshold", "1024",
                           "--scheduling-policy", "priority",
                           "--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 3}')
    assert code == 0, err
    sc = load_scenario(out)
    e = sc.engine
    assert sc.model.name == "qwen3-32b" and e.tensor_parallel_size == 2
    assert (e.max_num_batched_tokens, e.max_num_seqs, e.max_model_len) == (4096, 64, 32768)
    assert (e.block_size, e.gpu_memory_utilization, e.kv_cache_dtype) == (32, 0.85, "fp8")
    assert (e.enable_prefix_caching, e.async_scheduling) == (False, True)
    assert (e.long_prefill_token_threshold, e.scheduling_policy) == (1024, "priority")
    assert (sc.speculative.method, sc.speculative.num_speculative_tokens) == ("eagle3", 3)
    assert main(["run", str(out), "--out", str(tmp_path / "run"), "-q"]) == 0


@pytest.mark.parametrize("words, key, value", [
    (["--tensor-parallel-size", "2"], "tensor_parallel_size", 2),
    (["--tensor_parallel_size=2"], "tensor_parallel_size", 2),
    (["--num-gpu-blocks-override", "4000"], "num_gpu_blocks", 4000),
    (["--enable-prefix-caching"], "enable_prefix_caching", True),
    (["--no-async-scheduling"], "async_scheduling", False),
    (["--disable-chunked-prefill", "--max-num-batched-tokens", "40960"], "enable_chunked_prefill", False),
    (["--max-model-len", "32k"], "max_model_len", 32000),
    (["--prefix-cache-retention-interval", "0"], "prefix_cache_retention_interval", 0),
])
def test_each_mapped_flag(tmp_path, capsys, words, key, value):
    code, out, err = _init(capsys, tmp_path, "serve", "qwen3-8b", *words)
    assert code == 0, err
    assert getattr(load_scenario(out).engine, key) == value


def test_mamba_cache_mode_and_dotted_speculative_config(tmp_path, capsys):
    code, out, err = _init(capsys, tmp_path, "Qwen/Qwen3.5-27B", "--mamba-cache-mode", "align",
                           "--speculative-config.method", "qwen3_5_mtp",
                           "--speculative-config.num_speculative_tokens", "2")
    assert code == 0, err
    sc = load_scenario(out)
    assert sc.engine.mamba_cache_mode == "align" and sc.speculative.method == "mtp"
    assert sc.speculative.num_speculative_tokens == 2


def test_an_unmodelled_flag_is_named_on_stderr(tmp_path, capsys):
    code, out, err = _init(capsys, tmp_path, "qwen3-8b", "--port", "8000", "--trust-remote-code")
    assert code == 0 and err[0] == "kvsim init: not modelled, left out: --port, --trust-remote-code"
    assert "port" not in out.read_text().split("[model]")[1]


@pytest.mark.parametrize("words, message", [
    (["qwen3-8b", "--max-num-seq", "8"], "--max-num-seq: vLLM 0.33.0 has no such flag (did you mean"),
    (["qwen3-8b", "--speculative-config", "{method: mtp}"], "--speculative-config: not valid JSON"),
    (["qwen3-8b", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": null}'],
     "--speculative-config num_speculative_tokens: must be an integer"),
    (["qwen3-8b", "--max-num-seqs", "many"], "--max-num-seqs: must be an integer"),
    (["qwen3-8b", "-tp", "3"], "-tp 3: 3 does not divide num_attention_heads (32)"),
    (["Nobody/Model-1B"], "Nobody/Model-1B: no shipped preset"),
    (["qwen3-8b", "--max-model-len"], "--max-model-len: expects a value"),
])
def test_bad_flags_are_one_line_errors_and_write_nothing(tmp_path, capsys, words, message):
    code, out, err = _init(capsys, tmp_path, "vllm", "serve", *words)
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_a_local_config_json(tmp_path, capsys):
    import json

    from kvsim import presets
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(presets.load("models", "gpt-oss-20b")["config"]))
    code, out, err = _init(capsys, tmp_path, "serve", str(tmp_path / "m"))
    assert code == 0, err
    assert tomllib.loads(out.read_text())["model"]["config"] == str(tmp_path / "m" / "config.json")
    assert len(load_scenario(out).engine.kv_groups) == 2


def test_the_client_command_after_a_second_separator_is_the_workload(tmp_path, capsys):
    # InferenceX's gpt-oss point: vllm serve with MXFP4 weights, then the benchmark client
    # (benchmarks/inferencex_runs.md): 10 x C prompts after 2 x C warm-ups, 0.8 range below L.
    code, out, err = _init(capsys, tmp_path, "vllm", "serve", "openai/gpt-oss-120b", "-tp", "2",
                           "--quantization", "mxfp4", "--", "python3", "benchmark_serving.py",
                           "--model", "openai/gpt-oss-120b", "--dataset-name", "random",
                           "--random-input-len", "1024", "--random-output-len", "1024",
                           "--random-range-ratio", "0.8", "--num-prompts", "40",
                           "--max-concurrency", "4", "--num-warmups", "8", "--ignore-eos",
                           "--seed", "3", hardware="b200")
    assert code == 0, err
    sc = load_scenario(out)
    w = sc.workload
    assert sc.model.quantization == "mxfp4" and sc.engine.tensor_parallel_size == 2
    assert (w.generator, w.random_input_len, w.random_output_len, w.random_range_ratio,
            w.random_range_rule) == ("random", 1024, 1024, 0.8, "below")
    assert (w.num_requests, w.max_concurrency, w.num_warmups) == (40, 4, 8)
    assert w.request_rate == float("inf") and sc.run.seed == 3
    assert err == ["kvsim init: not modelled, left out: --model",
                   f"kvsim init: wrote {out} (run it: kvsim run {out})"]
    assert main(["run", str(out), "--out", str(tmp_path / "run"), "-q"]) == 0
    # Either order; a vllm bench serve client draws its lengths centred on L.
    code, out, err = _init(capsys, tmp_path, "vllm", "bench", "serve", "--max-concurrency", "8",
                           "--", "vllm", "serve", "Qwen/Qwen3-8B")
    assert code == 0, err
    w = load_scenario(out).workload
    assert (w.max_concurrency, w.num_requests, w.random_range_rule) == (8, 1000, "centered")


@pytest.mark.parametrize("words, message", [
    (["vllm", "serve", "Qwen/Qwen3-32B", "--", "vllm", "bench", "serve", "--max-concurency", "4"],
     "--max-concurency: vllm bench serve: no such flag (did you mean --max-concurrency?)"),
    (["vllm", "serve", "Qwen/Qwen3-32B", "--", "vllm", "serve", "Qwen/Qwen3-8B"],
     "give one vllm serve command and at most one client command"),
    (["vllm", "bench", "serve"], "give the vllm serve command after --"),
    (["vllm", "serve", "Qwen/Qwen3-32B", "--quantization", "bitsandbytes"], "quantization"),
])
def test_bad_client_commands_are_one_line_errors(tmp_path, capsys, words, message):
    code, out, err = _init(capsys, tmp_path, *words)
    assert code == 2 and not out.exists()
    assert len(err) == 1 and message in err[0], err
