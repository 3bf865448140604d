"""How every shared-memory end waits for its peers: poll, then yield, then sleep.

Why this shape: a peer that is running answers within microseconds, so a wait starts by
polling; but processes here may outnumber cores, and a process that spins holds the core
its peer needs, so polling soon hands the core over with sched_yield (which returns at
once when no one else is runnable), and a longer wait sleeps, so an idle process costs no
core. Once sleeping, the waiter looks at what else can end the wait: whether the peer
process is still there (at least every ``alive_every_s``), and before every sleep whatever
the protocol asks (a peer that declared the channel broken, a writer that closed).

Each end builds one `Waiter` with its own checks and its own errors, so every protocol
keeps its own error texts while the loop is the same for all. The checks are bound once,
not per wait: when processes share a core, every wait's set-up is on the round trip's
critical path. Per wait, only the condition, the deadline and a value ``about`` the checks
receive (what is awaited, from whom) are passed.

A reader with a futex to sleep on (the message queue's) naps a whole ``alive_every_s`` at a
time: the writer wakes it. Otherwise sleeps back off exponentially up to ``max_sleep_s``,
trading wake-up latency for CPU.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

_sched_yield = getattr(os, "sched_yield", lambda: time.sleep(0))


@dataclass(frozen=True)
class WaitPolicy:
    """How a blocked end waits (local to one process).

    Pure polling until ``busy_s``, then polling with sched_yield until ``yield_s``, then
    sleeps: from ``first_sleep_s``, doubling up to ``max_sleep_s``, or on a futex.
    ``alive_every_s``: how often the peer is checked once sleeping.

    Pure spinning is harmful when processes outnumber cores (the spinner holds the core its
    peer needs), so the queue's default yields from the start; that costs nothing when the
    core is otherwise idle.
    """

    busy_s: float = 0.0
    yield_s: float = 5e-4
    max_sleep_s: float = 1e-3
    alive_every_s: float = 0.1
    first_sleep_s: float = 50e-6


def weak(method: Callable) -> Callable:
    """A bound method as a check that does not keep its object alive. An end holds its
    waiter; a waiter holding the end would make a cycle, and an end dropped without close()
    would then be freed (its name removed) only by the cyclic collector, some time later."""
    ref = weakref.WeakMethod(method)
    return lambda *args: ref()(*args)


class Waiter:
    """One end's wait loop and its checks; `wait` returns once a condition holds.

    ``timed_out(about)``: the error to raise at the deadline. ``watch(about)``: once
    sleeping, at most every ``alive_every_s``; raises when the peer is gone.
    ``between(ready, about)``: before every sleep; raises to end the wait, or tidies up.
    ``nap(seconds, ready)``: sleeps until woken (a futex), for waits that ask for it.
    ``cancellable``: `cancel` (from any thread) makes every wait, now or later, raise
    ``RuntimeError("cancelled")``, and wakes a sleeping one at once.
    """

    def __init__(self, policy: WaitPolicy, *, timed_out: Callable[[Any], BaseException],
                 watch: Optional[Callable[[Any], None]] = None,
                 between: Optional[Callable[[Callable[[], bool], Any], None]] = None,
                 nap: Optional[Callable[[float, Callable[[], bool]], None]] = None,
                 cancellable: bool = False):
        self.policy = policy
        self.cancelled = False
        self._timed_out, self._watch, self._between, self._nap = timed_out, watch, between, nap
        self._event = threading.Event() if cancellable else None
        self._sleep = time.sleep if self._event is None else self._event.wait

    def cancel(self) -> None:
        self.cancelled = True
        if self._event is not None:
            self._event.set()

    def wait(self, ready: Callable[[], bool], deadline: Optional[float], about: Any = None,
             napping: bool = False) -> None:
        """Return once ``ready()``; ``deadline`` in time.monotonic (None: none); ``napping``:
        sleep with ``nap`` (if the end has one)."""
        policy, clock = self.policy, time.monotonic
        busy_s, yield_s, sched_yield = policy.busy_s, policy.yield_s, _sched_yield
        start = clock()
        next_watch = pause = None  # set at the first sleep: most waits end before it
        while not ready():
            if self.cancelled:
                raise RuntimeError("cancelled")
            now = clock()
            if deadline is not None and now >= deadline:
                raise self._timed_out(about)
            waited = now - start
            if waited < busy_s:
                continue
            if waited < yield_s:
                sched_yield()
                continue
            if next_watch is None:
                next_watch, pause = start + policy.alive_every_s, policy.first_sleep_s
            if self._watch is not None and now >= next_watch:
                self._watch(about)
                next_watch = clock() + policy.alive_every_s  # from the watch's end: a slow watch never runs twice in a row
            if self._between is not None:
                self._between(ready, about)
            nap = self._nap if napping else None
            if nap is not None:
                step = policy.alive_every_s
            else:
                step, pause = pause, min(policy.max_sleep_s, pause * 2 or 1e-5)
            if deadline is not None:
                step = min(step, deadline - now)
            if nap is not None:
                nap(step, ready)
            else:
                self._sleep(step)
