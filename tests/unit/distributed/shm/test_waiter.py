"""The one wait loop of the shared-memory layer (distributed/shm/waiter.py), in one process.

The protocols' own tests (queue, all-reduce, hand-off) exercise it between real processes;
these pin down its contract: which check runs when, the back-off, cancellation, and that
each check's error is the caller's own.
"""

from __future__ import annotations

import threading
import time

import pytest

from spmd_engine.distributed.shm.waiter import Waiter, WaitPolicy

FAST = WaitPolicy(yield_s=1e-3, alive_every_s=0.02)


def ready_after(seconds: float):
    at = time.monotonic() + seconds
    return lambda: time.monotonic() >= at


def boom(*args):
    raise AssertionError("no check may run when already ready")


def test_ready_returns_without_any_check():
    waiter = Waiter(FAST, timed_out=boom, watch=boom, between=boom, nap=boom)
    waiter.wait(lambda: True, deadline=0.0, napping=True)


def test_the_deadline_raises_the_callers_own_error_with_what_was_awaited():
    waiter = Waiter(FAST, timed_out=lambda about: KeyError(f"mine: {about}"))
    t0 = time.monotonic()
    with pytest.raises(KeyError, match="mine: rank 1"):
        waiter.wait(lambda: False, t0 + 0.1, "rank 1")
    assert 0.1 <= time.monotonic() - t0 < 1.0


def test_cancel_from_another_thread_ends_a_sleeping_wait_at_once_and_every_later_one():
    waiter = Waiter(WaitPolicy(yield_s=0.0, first_sleep_s=0.5, max_sleep_s=0.5),
                    timed_out=TimeoutError, cancellable=True)
    timer = threading.Timer(0.2, waiter.cancel)
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="^cancelled$"):
        waiter.wait(lambda: False, None)
    assert time.monotonic() - t0 < 0.45  # woken, not at the end of its 0.5 s sleep
    timer.join()
    with pytest.raises(RuntimeError, match="^cancelled$"):
        waiter.wait(lambda: False, None)


def test_watch_runs_once_sleeping_at_most_every_alive_every_s():
    seen = []
    Waiter(FAST, timed_out=TimeoutError, watch=lambda about: seen.append(time.monotonic())) \
        .wait(ready_after(0.25), None)
    assert 1 <= len(seen) <= 13, seen  # about every 20 ms over 250 ms, fewer on a busy machine
    assert all(b - a >= 0.02 for a, b in zip(seen, seen[1:]))


def test_between_runs_before_every_sleep_and_its_error_ends_the_wait():
    sleeps, rounds = [], []

    def between(ready, about):
        assert about == "the writer" and ready() is False
        rounds.append(len(sleeps))
        if len(rounds) == 4:
            raise EOFError("closed")
    waiter = Waiter(WaitPolicy(yield_s=0.0), timed_out=TimeoutError, between=between)
    waiter._sleep = sleeps.append
    with pytest.raises(EOFError, match="closed"):
        waiter.wait(lambda: False, None, "the writer")
    assert rounds == [0, 1, 2, 3]


@pytest.mark.parametrize("first, expected", [
    (50e-6, [50e-6, 100e-6, 200e-6, 400e-6, 800e-6, 1e-3, 1e-3]),  # the queue's default
    (0.0, [0.0, 1e-5, 2e-5, 4e-5, 8e-5, 16e-5, 32e-5]),  # the all-reduce's
])
def test_sleeps_back_off_exponentially_up_to_max_sleep_s(first, expected):
    sleeps = []

    def sleep(seconds):
        sleeps.append(seconds)
        if len(sleeps) == len(expected):
            raise StopIteration
    waiter = Waiter(WaitPolicy(yield_s=0.0, first_sleep_s=first), timed_out=TimeoutError)
    waiter._sleep = sleep
    with pytest.raises(StopIteration):
        waiter.wait(lambda: False, None)
    assert sleeps == pytest.approx(expected)


def test_a_futex_nap_sleeps_a_whole_watch_period_and_never_past_the_deadline():
    naps = []

    def nap(seconds, ready):
        naps.append(seconds)
        time.sleep(seconds)
    waiter = Waiter(WaitPolicy(yield_s=0.0, alive_every_s=0.05), timed_out=lambda about: TimeoutError(),
                    nap=nap)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        waiter.wait(lambda: False, t0 + 0.12, napping=True)
    assert naps[0] == pytest.approx(0.05, abs=5e-3) and all(s <= 0.05 for s in naps)
    assert naps[-1] < 0.05  # cut to what was left of the deadline
    naps.clear()
    with pytest.raises(TimeoutError):  # a wait that does not ask to nap sleeps instead
        waiter.wait(lambda: False, time.monotonic() + 0.05)
    assert naps == []


def test_an_end_dropped_without_close_is_freed_at_once():
    # Its checks are its own methods: held strongly by its waiter they would make a cycle,
    # and a creator's __del__ (which removes a forgotten queue's name) would wait for the
    # cyclic collector.
    import gc
    import os

    from spmd_engine.distributed.shm.message_queue import MessageQueue
    gc.disable()
    try:
        q = MessageQueue.create(1, label=f"drop{os.getpid()}", chunk_bytes=4096, n_chunks=4)
        path = "/dev/shm" + q.handle().shm_name
        assert os.path.exists(path)
        del q
        assert not os.path.exists(path)
    finally:
        gc.enable()
