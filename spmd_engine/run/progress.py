"""The progress line a person watching a long run sees (rank 0, a terminal, not --quiet)."""

from __future__ import annotations

import sys
import time

from spmd_engine.distributed.launch_env import launched_rank


class Progress:
    """Requests done and tokens/s on stderr, for a person watching a long run.

    Shown by global rank 0 only, and only when stderr is a terminal and --quiet
    is off, so tests and torchrun's --tee / --log-dir files stay clean. Under a
    launcher rank 0 sees its own replica, and says so. Fed by the engine as
    requests finish; redrawn at most every REDRAW_S seconds, and at the end.
    """

    REDRAW_S = 0.2

    def __init__(self, total: int, label: str = "", stream=None):
        self.total, self.label, self.stream = total, label, stream or sys.stderr
        self.done = self.tokens = 0
        self.start = self.drawn = time.monotonic()

    def update(self, requests: int, tokens: int) -> None:
        self.done += requests
        self.tokens += tokens
        now = time.monotonic()
        if self.done < self.total and now - self.drawn < self.REDRAW_S:
            return
        self.drawn = now
        elapsed = max(now - self.start, 1e-9)
        end = "\n" if self.done >= self.total else ""
        print(f"\r[progress] {self.done}/{self.total} requests{self.label}, {self.tokens} tokens, "
              f"{self.tokens / elapsed:.1f} tok/s, {elapsed:.0f}s", end=end, file=self.stream, flush=True)


def progress_wanted(args) -> bool:
    return not args.quiet and launched_rank() == 0 and sys.stderr.isatty()
