"""Azure LLM inference traces (Azure/AzurePublicDataset, 2023 and 2024): CSV with a header.

    TIMESTAMP,ContextTokens,GeneratedTokens
    2023-11-16 18:17:03.9799600,4808,10

Arrivals are seconds after the first row's timestamp. The trace has lengths only, so every
request gets a prompt of its own: row i's tokens are a run of ``ContextTokens`` ids starting
after all earlier rows' runs (``AZURE_TOKEN_BASE`` + the sum of earlier lengths), shared with
no other request. Prefix caching therefore finds nothing to reuse in an Azure trace, as
intended for a trace that says nothing about shared content.
"""

from __future__ import annotations

import csv
import datetime as dt
from pathlib import Path

from kvsim.errors import ConfigError
from kvsim.request import RequestSpec, SegmentTokens

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
AZURE_TOKEN_BASE = 1


def _nanoseconds(text: str) -> int:
    """``YYYY-MM-DD HH:MM:SS[.fraction]`` (up to 9 fraction digits) -> integer nanoseconds."""
    date, _, clock = text.strip().replace("T", " ").partition(" ")
    whole, _, frac = clock.partition(".")
    day = dt.date.fromisoformat(date)
    h, m, s = (int(x) for x in whole.split(":"))
    if not (0 <= h < 24 and 0 <= m < 60 and 0 <= s < 61) or len(frac) > 9 or (
            frac and not frac.isdigit()):
        raise ValueError(text)
    return (day.toordinal() * 86400 + h * 3600 + m * 60 + s) * 10**9 + int(frac.ljust(9, "0"))


def _count(text: str, name: str, where: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise ConfigError(where, f"{name} must be an integer, got {text!r}") from None
    if v < 1:
        raise ConfigError(where, f"{name} must be >= 1, got {v}")
    return v


def read_azure(path: Path) -> list[RequestSpec]:
    """Read an Azure LLM inference CSV trace. Raises ConfigError naming the file and line."""
    specs: list[RequestSpec] = []
    t0 = None
    next_id = AZURE_TOKEN_BASE
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:  # a BOM is tolerated
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None:
                raise ConfigError(str(path), "the trace holds no requests")
            if [h.strip() for h in header] != list(COLUMNS):
                raise ConfigError(f"{path}:1", f"header must be {','.join(COLUMNS)}, got "
                                  f"{','.join(header)!r}")
            for row in reader:
                lineno = reader.line_num
                where = f"{path}:{lineno}"
                if not row or not "".join(row).strip():
                    continue
                if len(row) != 3:
                    raise ConfigError(where, f"expected 3 fields ({','.join(COLUMNS)}), got {len(row)}")
                try:
                    t = _nanoseconds(row[0])
                except ValueError:
                    raise ConfigError(where, f"TIMESTAMP must look like 2023-11-16 18:17:03.97, "
                                      f"got {row[0]!r}") from None
                n_in = _count(row[1], "ContextTokens", where)
                n_out = _count(row[2], "GeneratedTokens", where)
                if t0 is None:
                    t0 = t
                if t < t0:
                    raise ConfigError(where, "TIMESTAMP is earlier than the first row's")
                specs.append(RequestSpec(req_id=f"az{len(specs)}", arrival_s=(t - t0) / 1e9,
                                         prompt=SegmentTokens([(next_id, n_in)]), max_tokens=n_out))
                next_id += n_in
    except OSError as exc:
        raise ConfigError(str(path), exc.strerror or str(exc)) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), f"not UTF-8 text: {exc.reason}") from None
    except csv.Error as exc:
        raise ConfigError(str(path), f"not valid CSV: {exc}") from None
    if not specs:
        raise ConfigError(str(path), "the trace holds no requests")
    return specs
