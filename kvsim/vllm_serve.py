"""``kvsim init``: a scenario from a ``vllm serve`` command line.

The flags are read as the release's own parser reads them: every option string it accepts
(long and short forms, ``--no-``/``--disable-`` negations, underscores for dashes, ``--x=v``,
``--speculative-config.key v``) comes from a table written from vLLM's parser
(``kvsim/presets/vllm_serve/<release>.json``, by ``kvsim/oracle/serve_flags.py``). A flag kvsim
models becomes its scenario key; a real flag kvsim does not model is named on stderr; a flag
the release does not have is an error with a suggestion. ``--hardware`` names the GPU: a
preset, a TOML file of [hardware] keys, or key=value pairs (``hardware_table``). A benchmark
client's command after a second ``--`` (``vllm bench serve …``, ``benchmark_serving.py …``)
becomes the ``[workload]`` (``kvsim.bench_client``); without one the workload is a placeholder.
"""

from __future__ import annotations

import difflib
import json
import math
import shlex
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from kvsim import presets
from kvsim.bench_client import Bench, is_client, parse_bench
from kvsim.config import _suggest, parse_scenario
from kvsim.errors import ConfigError
from kvsim.scenario_text import toml_value
from kvsim.schema import HARDWARE_KEYS, Key

# vLLM's destination -> kvsim [engine] key (vLLM's own names) and value type.
ENGINE_FLAGS: dict[str, tuple[str, str]] = {
    "tensor_parallel_size": ("tensor_parallel_size", "int"),
    "data_parallel_size": ("data_parallel_size", "int"),
    "enable_expert_parallel": ("enable_expert_parallel", "bool"),
    "api_server_count": ("api_server_count", "int"),
    "max_num_batched_tokens": ("max_num_batched_tokens", "int"),
    "max_num_seqs": ("max_num_seqs", "int"),
    "max_model_len": ("max_model_len", "int"),
    "block_size": ("block_size", "int"),
    "gpu_memory_utilization": ("gpu_memory_utilization", "float"),
    "num_gpu_blocks_override": ("num_gpu_blocks", "int"),
    "kv_cache_memory_bytes": ("kv_cache_memory_bytes", "int"),
    "kv_cache_dtype": ("kv_cache_dtype", "str"),
    "enable_prefix_caching": ("enable_prefix_caching", "bool"),
    "async_scheduling": ("async_scheduling", "bool"),
    "enable_chunked_prefill": ("enable_chunked_prefill", "bool"),
    "long_prefill_token_threshold": ("long_prefill_token_threshold", "int"),
    "scheduling_policy": ("scheduling_policy", "str"),
    "mamba_cache_mode": ("mamba_cache_mode", "str"),
    "prefix_cache_retention_interval": ("prefix_cache_retention_interval", "int"),
}
# vLLM's destination -> kvsim [model] key.
MODEL_FLAGS: dict[str, tuple[str, str]] = {"quantization": ("quantization", "str")}
# --speculative-config keys that are [speculative] keys of the same name, with their types; the
# others (the drafter checkpoint's "model", kernel settings) are read and named as not modelled.
SPEC_KEYS = {"method": "str", "num_speculative_tokens": "int", "disable_eagle_block_drop": "bool",
             "disable_lookahead_block_hashes": "bool", "parallel_drafting": "bool"}
# vLLM's model-specific MTP method names, which its SpeculativeConfig turns into "mtp".
SPEC_METHOD_ALIASES = {"deepseek_mtp": "mtp", "qwen3_next_mtp": "mtp", "qwen3_5_mtp": "mtp",
                       "ernie_mtp": "mtp", "glm4_moe_mtp": "mtp", "mimo_mtp": "mtp"}


@dataclass
class Serve:
    """What a command line says, as scenario keys."""

    model: str | None = None
    model_keys: dict[str, tuple[Any, str]] = field(default_factory=dict)   # key -> (value, flag)
    engine: dict[str, tuple[Any, str]] = field(default_factory=dict)
    speculative: dict[str, tuple[Any, str]] = field(default_factory=dict)
    not_modelled: list[str] = field(default_factory=list)


def flag_table(version: str) -> dict[str, dict]:
    """The option strings of ``vllm serve`` in ``version`` (kvsim/presets/vllm_serve)."""
    folder = resources.files("kvsim") / "presets" / "vllm_serve"
    names = sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))
    name = version if version in names else next(
        (n for n in names if n.rsplit(".", 1)[0] == version.rsplit(".", 1)[0]), None)
    if name is None:
        raise ConfigError("--vllm", f"no flag table for vLLM {version} (have {', '.join(names)})")
    with (folder / f"{name}.json").open("rb") as f:
        return json.load(f)["options"]


def human_int(text: str, flag: str) -> int:
    """vLLM's human_readable_int: ``32k`` = 32,000, ``32K`` = 32,768 (also m/M, g/G)."""
    units = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}
    t = text.strip()
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise ConfigError(flag, f"must be an integer (like 8192, 32k or 32K), got {text!r}") from None


def _convert(value: Any, kind: str, flag: str) -> Any:
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(flag, f"must be true or false, got {value!r}")
        return value
    if kind == "int":
        if isinstance(value, bool):
            raise ConfigError(flag, f"must be an integer, got {value!r}")
        return value if isinstance(value, int) else human_int(str(value), flag)
    if kind == "float":
        try:
            return float(value)
        except ValueError:
            raise ConfigError(flag, f"must be a number, got {value!r}") from None
    return str(value)


def _serve_words(argv: list[str]) -> list[str]:
    """The command line without its leading ``vllm`` and ``serve`` (both optional)."""
    words = argv[1:] if argv[:1] == ["vllm"] else list(argv)
    return words[1:] if words[:1] == ["serve"] else words


def parse_serve(argv: list[str], version: str) -> Serve:
    """Read a ``vllm serve`` command line (``vllm`` and ``serve`` optional)."""
    table = flag_table(version)
    words = _serve_words(argv)
    out = Serve()
    spec_json: dict[str, Any] = {}
    spec_flag = "--speculative-config"
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if not word.startswith("-") or word == "-":
            if out.model is not None:
                raise ConfigError(word, f"unexpected argument (the model is {out.model!r})")
            out.model = word
            continue
        name, eq, value = word.partition("=")
        if name.startswith("--"):
            name = "--" + name[2:].replace("_", "-")
        key_path = ""
        if name.startswith(spec_flag + "."):  # --speculative-config.method mtp
            name, key_path = spec_flag, name[len(spec_flag) + 1:].replace("-", "_")
        entry = table.get(name)
        if entry is None:
            close = difflib.get_close_matches(name, list(table), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(name, f"vLLM {version} has no such flag{hint}")
        if entry["takes_value"]:
            if not eq:
                if i >= len(words):
                    raise ConfigError(name, "expects a value")
                value = words[i]
                i += 1
        elif eq:
            raise ConfigError(name, "takes no value")
        else:
            value = entry.get("sets", True)
        dest = entry["dest"]
        if dest == "model":
            out.model = value
        elif dest == "speculative_config":
            if key_path:
                spec_json[key_path] = _json_scalar(value)
            else:
                try:
                    parsed = json.loads(value)
                except json.JSONDecodeError as exc:
                    raise ConfigError(name, f"not valid JSON: {exc}") from None
                if not isinstance(parsed, dict):
                    raise ConfigError(name, "must be a JSON object, like "
                                      "'{\"method\": \"mtp\", \"num_speculative_tokens\": 2}'")
                spec_json.update(parsed)
        elif dest in ENGINE_FLAGS or dest in MODEL_FLAGS:
            key, kind = ENGINE_FLAGS.get(dest) or MODEL_FLAGS[dest]
            given = out.engine if dest in ENGINE_FLAGS else out.model_keys
            given[key] = (_convert(value, kind, name), word if eq or not entry["takes_value"]
                          else f"{name} {value}")
        else:
            out.not_modelled.append(name)
    for k, v in spec_json.items():
        if k in SPEC_KEYS:
            v = _convert(v, SPEC_KEYS[k], f"{spec_flag} {k}")
            if k == "method":
                v = SPEC_METHOD_ALIASES.get(v, v)
            out.speculative[k] = (v, f"{spec_flag} {k}")
        else:
            out.not_modelled.append(f"{spec_flag} {k}")
    return out


def _json_scalar(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def resolve_model(model: str | None) -> tuple[str, str, str]:
    """(key, value, comment) of [model] for MODEL: a preset, an HF id with one, or a path."""
    if model is None:
        raise ConfigError("MODEL", "missing: give the model as vllm serve takes it "
                          "(a preset name, a Hugging Face id with a shipped preset, or a config.json path)")
    name = presets.by_hf_id(model) or (model if presets.load("models", model) else None)
    if name is not None:
        return "preset", name, model if name != model else ""
    p = Path(model).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if p.is_file():
        return "config", str(p.resolve()), ""
    known = presets.names("models")
    close = difflib.get_close_matches(model, known, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise ConfigError(model, f"no shipped preset{hint} and no such config.json; kvsim reads "
                      "config.json offline: download it (huggingface-cli download "
                      f"{model} config.json) and give its path")


# What a [hardware] table without a preset must give in the scenario kvsim init writes (it has no
# [cost] section, so the roofline prices the steps), and what a model or flag adds to that: the
# scenario parser's own requirements (kvsim.config).
HARDWARE_NEEDS = ("memory_bytes, mem_bandwidth_bytes_per_s, peak_flops_per_s; compute_capability "
                  "for MLA and hybrid models; interconnect_bandwidth_bytes_per_s with "
                  "tensor_parallel_size > 1")
HARDWARE_FORMS = ("a preset (kvsim presets), a TOML file of [hardware] keys, or key=value pairs "
                  "(after a preset: its overrides)")


def _hardware_file(path: Path, keys: dict[str, Key]) -> dict[str, Any]:
    """The [hardware] keys of a spec file: a preset file's top-level keys (its ``source`` is
    provenance and dropped) or a ``[hardware]`` table; ``name`` defaults to the file's stem."""
    where = f"--hardware {path}"
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(where, f"cannot read it: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(where, f"not valid TOML: {exc}") from None
    if set(raw) == {"hardware"} and isinstance(raw["hardware"], dict):
        raw = raw["hardware"]
    table: dict[str, Any] = {}
    for name, value in raw.items():
        if name == "source":
            continue
        if name not in keys:
            raise ConfigError(where, f"{name}: unknown key{_suggest(name, list(keys))} "
                              "(a file gives [hardware] keys, as a preset file does)")
        table[name] = value
    table.setdefault("name", path.stem)
    return table


def _hardware_value(key: Key, text: str) -> Any:
    """A key=value pair's value, typed as the key is (a string, or a number: 5e12, 180e9)."""
    if not text:
        raise ConfigError(f"--hardware {key.name}", "empty value")
    if key.type == "str":
        return text[1:-1] if len(text) > 1 and text[0] == text[-1] and text[0] in "\"'" else text
    try:
        number = float(text)
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise ConfigError(f"--hardware {key.name}", f"must be a number (like 5e12), got {text!r}")
    return int(number) if key.type == "int" and number.is_integer() else number


def hardware_table(spec: str) -> dict[str, Any]:
    """The [hardware] table ``kvsim init --hardware SPEC`` writes: SPEC is a preset name
    (``b200``), a TOML file of [hardware] keys, comma-separated key=value pairs
    (``name=my-gpu,peak_flops_per_s=1.2e15,...``) or either of the first two followed by pairs
    that override it (``b200,mem_bandwidth_bytes_per_s=7e12``). Names and number syntax are
    checked here; ranges, and what a GPU with no preset still lacks, by the scenario's parse
    (``init``). Raises ConfigError naming ``--hardware``."""
    keys = {k.name: k for k in HARDWARE_KEYS}
    parts = [p.strip() for p in spec.split(",")]
    if not all(parts):
        raise ConfigError("--hardware", f"an empty entry in {spec!r}: give {HARDWARE_FORMS}")
    table: dict[str, Any] = {}
    if "=" not in parts[0]:
        first = parts.pop(0)
        path = Path(first).expanduser()
        if presets.load("hardware", first) is not None:
            table = {"preset": first}
        elif path.is_file():
            table = _hardware_file(path, keys)
        elif "/" in first or path.suffix:
            raise ConfigError("--hardware", f"no such file {first!r}")
        else:
            known = presets.names("hardware")
            raise ConfigError("--hardware", f"unknown hardware preset {first!r}"
                              f"{_suggest(first, known)}; known: {', '.join(known)}; or give a "
                              "TOML file of [hardware] keys, or key=value pairs (a GPU with no "
                              f"preset needs: {HARDWARE_NEEDS})")
    given: set[str] = set()
    for part in parts:
        name, eq, text = (s.strip() for s in part.partition("="))
        if not eq:
            raise ConfigError("--hardware", f"{part!r} is not key=value (only the first entry "
                              "names a preset or a file)")
        if name not in keys:
            raise ConfigError("--hardware", f"{name}: unknown key{_suggest(name, list(keys))}; "
                              f"keys: {', '.join(keys)}")
        if name in given or (name == "preset" and "preset" in table):
            raise ConfigError(f"--hardware {name}", "given twice")
        given.add(name)
        table[name] = _hardware_value(keys[name], text)
    order = list(keys)
    return dict(sorted(table.items(), key=lambda kv: order.index(kv[0])))


def _keyed(table: dict[str, tuple[Any, str]]) -> list[str]:
    """``key = value  # flag`` lines, the comments aligned."""
    width = max((len(f"{k} = {toml_value(v)}") for k, (v, _) in table.items()), default=0)
    return [f"{k} = {toml_value(v)}".ljust(width) + f"  # {flag}" for k, (v, flag) in table.items()]


def scenario_text(serve: Serve, model: tuple[str, str, str], hardware: str | dict[str, Any],
                  version: str, command: str, client: Bench | None = None) -> str:
    """The commented scenario TOML of a parsed command line (``model`` from resolve_model;
    ``hardware`` a preset name or a [hardware] table, as ``hardware_table`` returns;
    ``client`` the benchmark client's command, else a placeholder workload)."""
    key, value, note = model
    table = {"preset": hardware} if isinstance(hardware, str) else hardware
    lines = ["# Written by kvsim init from:", f"#   {command}",
             *([f"#   {client.command}"] if client else []),
             "# Each [engine] key carries vLLM's name; keys left out take vLLM's default for",
             "# vllm_version (docs/scenario.md)." + ("" if client else " The workload is a "
                                                     "placeholder: edit it to your traffic."),
             "", "[model]", f"{key} = {toml_value(value)}" + (f"  # {note}" if note else ""),
             *_keyed(serve.model_keys),
             "", "[hardware]", *(f"{k} = {toml_value(v)}" for k, v in table.items()), "",
             "[engine]", f"vllm_version = {toml_value(version)}", *_keyed(serve.engine)]
    if serve.speculative:
        lines += ["", "[speculative]", *_keyed(serve.speculative)]
    if client is None:
        lines += ["", "[workload]", 'kind = "synthetic"', 'generator = "shared_prefix"',
                  "num_requests = 200", "request_rate = 4.0", "system_prompt_tokens = 1024",
                  "user_history_tokens = 2048", "input_tokens = 256", "output_tokens = 256"]
    else:
        lines += ["", "[workload]", 'kind = "synthetic"', *_keyed(client.workload)]
        if client.seed is not None:
            lines += ["", "[run]", f"seed = {client.seed}  # --seed"]
    return "\n".join(lines) + "\n"


def split_commands(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """(the ``vllm serve`` words, the client's words or None) of ``kvsim init``'s words: the
    two commands apart at a ``--``, in either order."""
    parts: list[list[str]] = [[]]
    for word in argv:
        if word == "--":
            parts.append([])
        else:
            parts[-1].append(word)
    parts = [p for p in parts if p]
    clients = [p for p in parts if is_client(p)]
    servers = [p for p in parts if not is_client(p)]
    if len(clients) > 1 or len(servers) > 1:
        raise ConfigError("kvsim init", "give one vllm serve command and at most one client "
                          "command, apart at --: kvsim init -- vllm serve MODEL ... -- vllm "
                          "bench serve ...")
    if not servers:
        raise ConfigError("kvsim init", "give the vllm serve command after --, e.g. kvsim init "
                          "-- vllm serve Qwen/Qwen3-32B -tp 2")
    return servers[0], (clients[0] if clients else None)


def init(argv: list[str], hardware: str, version: str) -> tuple[str, list[str]]:
    """(scenario TOML, flags read but not modelled); the scenario is checked by parsing it.
    ``argv``: the ``vllm serve`` words, and a client's after a ``--`` (``split_commands``);
    ``hardware`` is ``--hardware``'s SPEC (``hardware_table``)."""
    argv, client_words = split_commands(argv)
    serve = parse_serve(argv, version)
    client = parse_bench(client_words) if client_words is not None else None
    model = resolve_model(serve.model)
    table = hardware_table(hardware)
    if "preset" not in table:  # every key at once, not the parse's first
        tp = serve.engine.get("tensor_parallel_size", (1, ""))[0]
        needed = ["memory_bytes", "mem_bandwidth_bytes_per_s", "peak_flops_per_s",
                  *(["interconnect_bandwidth_bytes_per_s"] if tp > 1 else [])]
        missing = [k for k in needed if k not in table]
        if missing:
            raise ConfigError("--hardware", f"missing {', '.join(missing)} (a GPU with no preset "
                              f"needs: {HARDWARE_NEEDS})")
    spec = serve.speculative  # mtp without num_speculative_tokens: the scenario's default
    command = shlex.join(["vllm", "serve", *_serve_words(argv)])
    text = scenario_text(serve, model, table, version, command, client)
    try:
        parse_scenario(tomllib.loads(text), Path("scenario.toml"))
    except ConfigError as exc:  # name the flag the key came from
        section, _, key = exc.where.removeprefix("scenario.toml: ").partition(".")
        given = {"model": serve.model_keys, "engine": serve.engine, "speculative": spec,
                 "workload": client.workload if client else {}}.get(section, {})
        if key in given:
            raise ConfigError(given[key][1], exc.what) from None
        if section == "hardware":
            if exc.what.startswith("missing"):
                raise ConfigError("--hardware", f"missing {key} (a GPU with no preset needs: "
                                  f"{HARDWARE_NEEDS})") from None
            raise ConfigError(f"--hardware {key}", exc.what) from None
        raise
    return text, serve.not_modelled + (client.not_modelled if client else [])
