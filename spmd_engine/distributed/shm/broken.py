"""Broken for good: once a shared-memory channel has failed, every later use raises.

Why no recovery: after a failure the two sides no longer agree on where they are. Half a
message may sit in a queue's ring (the reader cannot find the next message's start); a
rank that gave up on an all-reduce has moved on while its peer may still complete it; a
stage that abandoned a hand-off has its peer one message behind. Going on would pair
unrelated data. Nor does a failed channel fall back to gloo: a rank on gloo and its peer
on shared memory would wait for each other until the timeout. So the first failure's
reason is kept and every later call fails with it, on this rank; protocols whose peers
must learn of it too (the all-reduce) also raise a word in the shared segment.
"""

from __future__ import annotations

from typing import Optional


class Broken:
    """The reason an end failed, or None while it works. Set once, never cleared."""

    __slots__ = ("why",)

    def __init__(self) -> None:
        self.why: Optional[str] = None  # read directly (no __bool__): checked on every call

    def set(self, why: str) -> str:
        """Record ``why`` unless a reason is already kept; returns the kept reason."""
        if self.why is None:
            self.why = why
        return self.why
