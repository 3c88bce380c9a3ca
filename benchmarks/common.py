"""What the benchmark scripts share: timing a whole child process, and how to start kvsim."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path


def kvsim_env(cache: Path) -> dict:
    """The environment kvsim runs in: modules byte-compiled once and reused, as an installed
    package's are (under PYTHONDONTWRITEBYTECODE=1 every run would compile every module
    again); the byte-code goes under ``cache`` (PYTHONPYCACHEPREFIX, unless already set),
    not beside the sources."""
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.setdefault("PYTHONPYCACHEPREFIX", str(cache))
    return env


# Started by a small process: Linux keeps a process's peak RSS across exec, so a child forked
# straight from this one (grown by the results it holds) would report this one's size.
_RUN = """\
import os, subprocess, sys, time
start = time.perf_counter()
proc = subprocess.Popen(sys.argv[2:], stdout=subprocess.DEVNULL)
_, status, usage = os.wait4(proc.pid, 0)
wall = time.perf_counter() - start
with open(sys.argv[1], "w") as f:
    f.write(f"{wall!r} {os.waitstatus_to_exitcode(status)} {usage.ru_maxrss}")
"""


def timed(cmd: list[str], env: dict | None = None) -> tuple[float, int, int]:
    """Run ``cmd``; (wall seconds, exit status, peak RSS in MiB) of the child process, timed
    and measured by a small process that starts it."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "usage"
        rc = subprocess.call([sys.executable, "-c", _RUN, str(out), *cmd], env=env)
        if not out.exists():
            return 0.0, rc or 1, 0
        wall, status, rss = out.read_text().split()
    return float(wall), int(status), int(rss) // 1024


def kvsim_command() -> list[str]:
    """``kvsim`` as a user starts it: the console script next to this interpreter."""
    script = Path(sys.executable).with_name("kvsim")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from kvsim.cli import main; main()"]


def repeated(cmd: list[str], env: dict, repeats: int) -> tuple[list[float], int] | None:
    """``cmd`` run ``repeats`` times: (each run's wall seconds, the highest peak RSS in MiB),
    or None as soon as one fails."""
    walls, peak = [], 0
    for _ in range(repeats):
        wall, rc, rss = timed(cmd, env)
        if rc:
            return None
        walls.append(wall)
        peak = max(peak, rss)
    return walls, peak
