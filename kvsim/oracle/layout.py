"""The KV-cache layout vLLM itself builds for a model config, from an oracle environment.

``vllm_layout(config)`` writes ``config`` as ``config.json`` into a temporary folder and runs
``layout_driver.py`` (vLLM's own engine path: EngineArgs -> meta-device model -> the worker's
KV-cache specs -> the engine core's KV-cache planner) with the oracle environment's interpreter
for ``version`` (``make_env.sh``). Settings are the driver's input keys::

    vllm_layout(cfg, version="0.33.0", tensor_parallel_size=2, device_capability=(10, 0),
                kv_cache_memory_bytes=8 << 30, max_model_len=32768)

Returns the driver's JSON (``block_size``, ``num_blocks``, ``groups``, ...). Raises
RuntimeError with the driver's stderr tail when vLLM fails, ConfigError (from
``oracle_python``) when the environment is missing.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

from kvsim.errors import ConfigError
from kvsim.oracle.validate import oracle_python as _oracle_python

DRIVER = Path(__file__).with_name("layout_driver.py")
SETTINGS = (
    "tensor_parallel_size",
    "device_capability",
    "device_name",
    "total_memory_bytes",
    "kv_cache_dtype",
    "block_size",
    "enable_prefix_caching",
    "mamba_cache_mode",
    "max_model_len",
    "kv_cache_memory_bytes",
    "speculative_config",
    "language_model_only",
)


def available(version: str = "0.33.0") -> bool:
    """Whether an oracle environment for ``version`` exists."""
    try:
        _oracle_python(version, None)
    except ConfigError:
        return False
    return True


def vllm_layout(config: dict, *, version: str = "0.33.0", oracle_python: str | None = None,
                timeout: float | None = 900, **settings) -> dict:
    """vLLM ``version``'s KV-cache layout for the model described by ``config`` (config.json)."""
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        raise TypeError(f"unknown layout settings: {sorted(unknown)}")
    python = _oracle_python(version, oracle_python)
    if "device_capability" in settings and settings["device_capability"] is not None:
        settings["device_capability"] = list(settings["device_capability"])
    with tempfile.TemporaryDirectory(prefix="kvsim-layout-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        request = {"config_dir": tmp, **settings}
        try:
            proc = subprocess.run([str(python), str(DRIVER)], input=json.dumps(request),
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"vLLM {version} layout driver timed out after {timeout} s") from e
    tail = "\n".join(proc.stderr.strip().splitlines()[-25:])
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else None
    except json.JSONDecodeError:
        result = None
    if proc.returncode != 0 or not isinstance(result, dict) or "error" in result:
        err = result.get("error") if isinstance(result, dict) else "no output"
        raise RuntimeError(f"vLLM {version} layout driver failed (exit {proc.returncode}): "
                           f"{err}\n--- stderr tail ---\n{tail}")
    return result
