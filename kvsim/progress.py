"""Progress bars, through tqdm: rate and ETA, redrawn at most twice a second, and silent when
stderr is not a terminal (a log or a pipe gets no bar lines)."""

from __future__ import annotations

import sys

from tqdm import tqdm


class RunProgress:
    """The engine loop's callback ``(step, sim_s, finished, total)`` as a bar of finished
    requests (``total`` 0: not known, as for a streamed trace)."""

    def __init__(self) -> None:
        self.bar = tqdm(total=None, desc="requests", unit="req", file=sys.stderr, disable=None,
                        mininterval=0.5, leave=False, dynamic_ncols=True)

    def __call__(self, step: int, sim_s: float, finished: int, total: int) -> None:
        if step % 256:  # the loop calls every step; a bar moves far less often
            return
        if total and self.bar.total != total:
            self.bar.total = total
        self.bar.set_postfix_str(f"step {step}, {sim_s:.1f} s simulated", refresh=False)
        self.bar.update(finished - self.bar.n)

    def close(self) -> None:
        self.bar.close()


class PointProgress:
    """A sweep's callback ``(done, total, done_before)`` as a bar of finished points; points
    finished by an earlier run of the sweep count from the start and not in the rate."""

    def __init__(self) -> None:
        self.bar: tqdm | None = None

    def __call__(self, done: int, total: int, done_before: int) -> None:
        if self.bar is None:
            if done_before:  # said on any stream: a log shows what the rerun skipped
                print(f"resuming: {done_before} of {total} points done before", file=sys.stderr)
            self.bar = tqdm(total=total, initial=done_before, desc="points", unit="point",
                            file=sys.stderr, disable=None, dynamic_ncols=True)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
