"""Known public traces: where they come from, where kvsim keeps them, how to fetch one.

The trace cache is ``$KVSIM_TRACE_DIR`` if set, else ``$XDG_CACHE_HOME/kvsim/traces``, else
``~/.cache/kvsim/traces``. Each trace lives there under its ``file`` path (the layout of the
source repositories: ``mooncake/conversation_trace.jsonl``, ``azure/...csv``), so a folder
holding copies of the files in that layout can serve as the cache. ``kvsim traces`` lists the
traces, ``kvsim traces download NAME`` fetches one (needs internet access), and a scenario
names one with ``[workload] trace = "NAME"``.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import os
import shutil
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvsim.errors import ConfigError

MOONCAKE = "https://raw.githubusercontent.com/kvcache-ai/Mooncake/main/FAST25-release"
AZURE_2023 = "https://raw.githubusercontent.com/Azure/AzurePublicDataset/master/data"
AZURE_2024 = "https://azurepublicdatasettraces.blob.core.windows.net/azurellminfererencetrace"


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    format: str  # a workload.format
    file: str  # path inside the cache folder
    url: str
    license: str
    description: str
    num_bytes: int | None = None  # None: not recorded
    sha256: str | None = None  # checked after a download when known
    num_requests: int | None = None


KNOWN: dict[str, Trace] = {t.name: t for t in (
    Trace("mooncake-conversation", "mooncake", "mooncake/conversation_trace.jsonl",
          f"{MOONCAKE}/traces/conversation_trace.jsonl", "Apache-2.0",
          "Mooncake FAST'25: one hour of Kimi chat requests with prefix hash ids",
          3_029_533, "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df", 12_031),
    Trace("mooncake-synthetic", "mooncake", "mooncake/synthetic_trace.jsonl",
          f"{MOONCAKE}/traces/synthetic_trace.jsonl", "Apache-2.0",
          "Mooncake FAST'25: built from public datasets, Poisson arrivals",
          1_136_313, "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131", 3_993),
    Trace("mooncake-toolagent", "mooncake", "mooncake/toolagent_trace.jsonl",
          f"{MOONCAKE}/traces/toolagent_trace.jsonl", "Apache-2.0",
          "Mooncake FAST'25: one hour of tool and agent requests", None, None, 23_608),
    Trace("mooncake-arxiv", "mooncake", "mooncake/mooncake_trace.jsonl",
          f"{MOONCAKE}/arxiv-trace/mooncake_trace.jsonl", "Apache-2.0",
          "Mooncake arXiv technical report trace (the older single file)", None, None, 23_608),
    Trace("azure-code-2023", "azure", "azure/AzureLLMInferenceTrace_code.csv",
          f"{AZURE_2023}/AzureLLMInferenceTrace_code.csv", "CC-BY-4.0 (cite Splitwise, ISCA'24)",
          "Azure LLM inference 2023, code completion, one hour, lengths only",
          320_117, "54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6", 8_819),
    Trace("azure-conv-2023", "azure", "azure/AzureLLMInferenceTrace_conv.csv",
          f"{AZURE_2023}/AzureLLMInferenceTrace_conv.csv", "CC-BY-4.0 (cite Splitwise, ISCA'24)",
          "Azure LLM inference 2023, conversation, one hour, lengths only",
          719_188, "2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8", 19_366),
    Trace("azure-code-2024", "azure", "azure/AzureLLMInferenceTrace_code_1week.csv",
          f"{AZURE_2024}/AzureLLMInferenceTrace_code_1week.csv",
          "CC-BY-4.0 (cite DynamoLLM, HPCA'25)", "Azure LLM inference 2024, code, one week"),
    Trace("azure-conv-2024", "azure", "azure/AzureLLMInferenceTrace_conv_1week.csv",
          f"{AZURE_2024}/AzureLLMInferenceTrace_conv_1week.csv",
          "CC-BY-4.0 (cite DynamoLLM, HPCA'25)", "Azure LLM inference 2024, conversation, one week"),
)}


def cache_dir() -> Path:
    """The trace cache folder (it need not exist)."""
    env = os.environ.get("KVSIM_TRACE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvsim" / "traces"


def known(name: str, where: str = "trace") -> Trace:
    """The known trace ``name``. Raises ConfigError (with a suggestion) if there is none."""
    t = KNOWN.get(name)
    if t is None:
        close = difflib.get_close_matches(name, list(KNOWN), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(where, f"unknown trace {name!r}{hint}; known: {', '.join(KNOWN)}")
    return t


def locate(name: str, where: str = "trace") -> Path:
    """The cached file of the known trace ``name``. Raises ConfigError if it is not there."""
    t = known(name, where)
    p = cache_dir() / t.file
    if not p.is_file():
        raise ConfigError(where, f"trace {name!r} is not in the trace cache: expected {p}; run "
                          f"`kvsim traces download {name}` where there is internet access, copy the "
                          f"file there, or set KVSIM_TRACE_DIR to a folder holding {t.file}")
    return p


def size_text(n: int | None) -> str:
    if n is None:
        return "size unknown"
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


def download(name: str, folder: Path | None = None, timeout_s: float = 30.0) -> Path:
    """Fetch the known trace ``name`` into ``folder`` (default: the cache). Returns its path.

    Writes to a temporary file and renames it when complete (and its checksum, where known,
    matches), so a cached file is never partial. Raises ConfigError with one line on failure.
    """
    t = known(name)
    dest = (folder or cache_dir()) / t.file
    where = f"traces download {name}"
    created = [p for p in dest.parents if not p.exists()]  # removed again if nothing lands
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.partial-", dir=dest.parent)
    except OSError as exc:
        raise ConfigError(where, f"cannot write to {dest.parent}: {exc.strerror or exc}") from None
    tmp = Path(tmp_name)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            try:
                req = urllib.request.Request(t.url, headers={"User-Agent": "kvsim"})
                with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                    while chunk := resp.read(1 << 20):
                        digest.update(chunk)
                        out.write(chunk)
            except (urllib.error.URLError, OSError, ValueError) as exc:
                reason = getattr(exc, "reason", None) or exc
                raise ConfigError(where, f"cannot download {t.url}: {reason}") from None
        if t.sha256 and digest.hexdigest() != t.sha256:
            raise ConfigError(where, f"checksum mismatch for {t.url} (got sha256 {digest.hexdigest()}, "
                              f"expected {t.sha256}); nothing was saved")
        shutil.move(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        for folder_made in created:  # deepest first: a failed download leaves no empty folders
            with contextlib.suppress(OSError):
                folder_made.rmdir()
        raise
    finally:
        tmp.unlink(missing_ok=True)
    return dest
