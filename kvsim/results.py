"""Result folders: written whole by one rename, and recognised when read back.

A run folder holds ``RESULT_FILES``; a comparison adds ``compare.csv`` and one run folder per
variant; a sweep holds ``sweep.json``, one run folder per point under ``points/`` and, once
every point has run, ``sweep.csv``. A folder named as the result is complete: it is written
under a temporary name (``NAME.partial-XXXX``, visible) and renamed into place, so an
interrupted write leaves nothing that looks like a result.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from kvsim.errors import ConfigError

RESULT_FILES = ("requests.csv", "steps.csv", "summary.json", "scenario.resolved.toml")


PARTIAL = ".partial-"  # in the name of a folder being written: NAME.partial-XXXX


def is_partial(path: Path) -> bool:
    """A folder ``result_folder`` was writing when its process died (SIGKILL, power loss)."""
    return PARTIAL in path.name


def _check_out(out: Path, replace: bool) -> None:
    """What may be written at ``out``: nothing there, an empty folder, or (with ``replace``)
    an earlier run or comparison. Raises ConfigError naming what is in the way."""
    for parent in out.parents:  # a file where a folder should be
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(str(out), f"{parent} is a file, not a folder")
            break
    if not out.exists():
        return
    if not out.is_dir():
        raise ConfigError(str(out), "is a file; choose another --out")
    if (out / "sweep.json").is_file():
        raise ConfigError(str(out), "holds a kvsim sweep; choose another --out")
    if (out / "summary.json").is_file() or (out / "compare.csv").is_file():
        if not replace:
            raise ConfigError(str(out), "holds an earlier kvsim result; give --force to replace "
                              "it, or choose another --out")
        return
    if any(out.iterdir()):
        raise ConfigError(str(out), "exists and is not a kvsim result folder; choose another --out")


@contextmanager
def result_folder(out: Path, replace: bool = False):
    """A temporary sibling folder ``NAME.partial-XXXX`` to write into, renamed to ``out`` once
    the block ends without an error, else removed (SIGTERM included: ``kvsim.cli`` turns it
    into an exception): a folder named ``out`` is complete. ``replace``: an earlier result at
    ``out`` is replaced (``--force``); see ``_check_out`` for what else is refused."""
    _check_out(out, replace)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}{PARTIAL}", dir=out.parent))
    except OSError as exc:
        raise ConfigError(str(out), f"cannot create the result folder: {exc.strerror or exc}") from None
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_results(out: Path, files: dict[str, str], extra=None, replace: bool = False) -> None:
    """Write ``files`` (relative paths to text) into ``out`` through ``result_folder``;
    ``extra(tmp_dir)`` may write more (figures)."""
    with result_folder(out, replace) as tmp:
        for name, text in files.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_text(text, encoding="utf-8")
        if extra is not None:
            extra(tmp)


def write_file(path: Path, text: str) -> None:
    """Write one file under a temporary name and rename it into place."""
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def kind(folder: Path) -> str:
    """``"sweep"``, ``"compare"`` or ``"run"``; raises ConfigError for anything else."""
    if not folder.is_dir():
        raise ConfigError(str(folder), "no such result folder")
    if (folder / "sweep.json").is_file():
        if not (folder / "sweep.csv").is_file():
            raise ConfigError(str(folder), "the sweep has not finished (no sweep.csv); run kvsim "
                              "sweep again to resume it")
        return "sweep"
    if (folder / "compare.csv").is_file():
        return "compare"
    if all((folder / f).is_file() for f in RESULT_FILES):
        return "run"
    raise ConfigError(str(folder), "not a kvsim result folder (no summary.json, compare.csv or "
                      "sweep.json)")
