"""The exceptions kvsim raises on purpose: bad input, broken internal state, and a vLLM release's
own failure reproduced."""


class ConfigError(ValueError):
    """Bad user input: a scenario key, a trace line, a missing file.

    ``where`` names the place (``engine.block_size``, ``trace.jsonl:12``); the CLI prints
    ``kvsim: error: <where>: <what>`` and exits with status 2.
    """

    def __init__(self, where: str, what: str):
        super().__init__(f"{where}: {what}")
        self.where = where
        self.what = what


class InvariantError(RuntimeError):
    """kvsim's own accounting broke a rule that must always hold (a bug, never bad input)."""


class EngineDeadError(RuntimeError):
    """vLLM's own code raises where this release does, and its engine core dies (clients then
    get vLLM's EngineDeadError): e.g. 0.20.0's per-step block count, capped for sliding
    windows, passes a check the allocation then fails (``BlockPool.get_new_blocks``:
    ``ValueError: Cannot get N free blocks from the pool``). The run ends there, as vLLM's
    would. ``str(exc)`` is vLLM's exception as it prints it."""
