"""The two exceptions kvsim raises on purpose: bad input, and broken internal state."""


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
