"""``kvsim init``'s client half: a ``[workload]`` from the benchmark client's own command line.

``vllm bench serve`` (and the older ``benchmarks/benchmark_serving.py``, which InferenceX and
SGLang's ``bench_serving`` descend from) sends ``--num-prompts`` requests of a dataset at
``--request-rate`` (default ``inf``: all due at once), at most ``--max-concurrency`` in flight,
after ``--num-warmups`` warm-ups (``kvsim.client``). The random dataset's flags become the
``random`` generator's keys; the two clients draw its lengths differently
(``random_range_rule``). Flags that change nothing kvsim models (where the server is, the
tokenizer, what is saved) are named as not modelled; a flag close to a modelled one's
spelling is taken for a typo.
"""

from __future__ import annotations

import difflib
import math
import shlex
from dataclasses import dataclass, field
from typing import Any

from kvsim.errors import ConfigError

# Flag -> ([workload] key, type). Both clients' spellings (SGLang's --random-input etc.).
FLAGS: dict[str, tuple[str, str]] = {
    "--num-prompts": ("num_requests", "int"),
    "--request-rate": ("request_rate", "float"),
    "--max-concurrency": ("max_concurrency", "int"),
    "--num-warmups": ("num_warmups", "int"),
    "--random-input-len": ("random_input_len", "int"),
    "--random-input": ("random_input_len", "int"),
    "--random-output-len": ("random_output_len", "int"),
    "--random-output": ("random_output_len", "int"),
    "--random-range-ratio": ("random_range_ratio", "float"),
    "--random-prefix-len": ("random_prefix_len", "int"),
}
# Flags read apart: the dataset, arrival burstiness, the seed, end-of-sequence handling.
OTHER = ("--dataset-name", "--burstiness", "--seed", "--ignore-eos")
# Defaults where the client's differ from kvsim's [workload] defaults (vllm bench serve's).
CLIENT_DEFAULTS: dict[str, Any] = {"num_requests": 1000, "request_rate": math.inf}
SWITCHES = ("--ignore-eos", "--disable-tqdm", "--save-result", "--save-detailed",
            "--trust-remote-code", "--disable-shuffle", "--profile", "--use-beam-search",
            "--append-result", "--insecure")


@dataclass
class Bench:
    """What a client command says, as [workload] keys with the flag each came from."""

    workload: dict[str, tuple[Any, str]] = field(default_factory=dict)
    seed: int | None = None
    not_modelled: list[str] = field(default_factory=list)
    program: str = ""  # "vllm bench serve" or "benchmark_serving.py"
    command: str = ""  # the whole command line


def is_client(words: list[str]) -> bool:
    """Whether ``words`` start a benchmark client's command."""
    head = " ".join(words[:4])
    return "bench serve" in head or "benchmark_serving" in head or "bench_serving" in head


def _program(words: list[str]) -> tuple[str, list[str]]:
    """(client, its flags): ``vllm bench serve`` or a benchmark_serving.py script."""
    for i, w in enumerate(words[:4]):
        if w == "serve" and i and words[i - 1] == "bench":
            return "vllm bench serve", words[i + 1:]
        if "benchmark_serving" in w or "bench_serving" in w:
            return "benchmark_serving.py", words[i + 1:]
    raise ConfigError("client command", "expected 'vllm bench serve ...' or 'python "
                      "benchmark_serving.py ...'")


def _number(text: str, kind: str, flag: str) -> Any:
    try:
        value = int(text) if kind == "int" else float(text)
    except ValueError:
        raise ConfigError(flag, f"expected {'an integer' if kind == 'int' else 'a number'}, "
                          f"got {text!r}") from None
    return value


def parse_bench(words: list[str]) -> Bench:
    """The client's command line as ``[workload]`` keys. Raises ConfigError naming the flag."""
    program, argv = _program(words)
    out = Bench(program=program, command=shlex.join(words))
    known = [*FLAGS, *OTHER]
    i = 0
    while i < len(argv):
        word = argv[i]
        i += 1
        if not word.startswith("--"):
            raise ConfigError(word, f"{program}: unexpected argument (flags start with --)")
        flag, eq, value = word.partition("=")
        flag = "--" + flag[2:].replace("_", "-")
        if not eq and flag not in SWITCHES and i < len(argv) and not argv[i].startswith("--"):
            value, i = argv[i], i + 1
        if flag in FLAGS:
            key, kind = FLAGS[flag]
            out.workload[key] = (_number(value, kind, flag), flag)
        elif flag == "--dataset-name":
            if value != "random":
                raise ConfigError(flag, f"{value!r} is not modelled: kvsim generates the random "
                                  "dataset; give another dataset's requests as a trace "
                                  "([workload] kind = 'trace')")
        elif flag == "--burstiness":
            b = _number(value, "float", flag)
            if b <= 0:
                raise ConfigError(flag, f"must be above 0, got {value}")
            if b != 1:  # gamma inter-arrival times of shape b: CV 1 / sqrt(b)
                out.workload["arrival"] = ("gamma", flag)
                out.workload["arrival_cv"] = (1 / math.sqrt(b), flag)
        elif flag == "--seed":
            out.seed = _number(value, "int", flag)
        elif flag == "--ignore-eos":
            pass  # kvsim generates every output to its drawn length, as --ignore-eos does
        else:
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.85)
            if close:
                raise ConfigError(flag, f"{program}: no such flag (did you mean {close[0]}?)")
            out.not_modelled.append(flag)
    if program == "benchmark_serving.py" and not any(
            w.partition("=")[0].replace("_", "-") == "--dataset-name" for w in argv):
        raise ConfigError("--dataset-name", "benchmark_serving.py's default dataset is sharegpt, "
                          "which kvsim does not generate: pass --dataset-name random, or give "
                          "the requests as a trace ([workload] kind = 'trace')")
    for key, value in CLIENT_DEFAULTS.items():
        if key not in out.workload:
            out.workload[key] = (value, f"{program}'s default")
    out.workload = {"generator": ("random", "--dataset-name random"),
                    "random_range_rule": ("centered" if program == "vllm bench serve" else "below",
                                          program), **out.workload}
    return out
