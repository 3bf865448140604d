"""Async scheduling where the step runs in the engine's own thread (uni, external_launcher).

Under mp a step is sent to the workers and the engine is free until it reads the
reply, so two steps in flight through the batch queue is all async scheduling
needs. Here the worker is in this process. Running the step on a second thread
would be the obvious shape, and on CPU it is the wrong one: torch's OpenMP runtime
(libgomp) cuts its spinning once more threads run parallel regions than there are
cores, and then every parallel region of the process, both threads', runs far slower
(docs/performance.md, async scheduling). So the step stays
on this thread and the host's work moves: while this thread runs step k, a helper
thread applies step k-1's output (tokens, finishes, stop strings) and schedules
step k+1 (the tokens step k samples are placeholders the runner fills in). The
helper only runs Python (the scheduler, the block manager, the detokenizer), never
a torch kernel, so it starts no OpenMP team; torch's kernels release the GIL, so it
runs while the forward does.

Between two calls nothing runs: one step is scheduled but not started (`next`) and
the last one's output is not applied yet (`last`). A drain runs and applies both.
After any failure, of the step or of the helper's work beside it, the scheduler and
the worker no longer agree on what ran, so every later call raises EngineDeadError.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from spmd_engine.core.request import Request
from spmd_engine.core.step_messages import ModelRunnerOutput, SchedulerOutput
from spmd_engine.engine.core_client import EngineDeadError


class OverlappedSteps:
    def __init__(self, schedule: Callable[..., SchedulerOutput | None], has_work: Callable[[], bool],
                 update: Callable[[SchedulerOutput, ModelRunnerOutput], list[Request]],
                 run: Callable[[SchedulerOutput], ModelRunnerOutput]):
        """`schedule(in_flight=, max_in_flight=)`, `has_work()` and `update(out, result)` are the
        scheduler's side (run on the helper thread while a step runs); `run(out)` runs a step
        to its output, on this thread. Exceptions of `run` propagate after the helper is idle."""
        self._schedule, self._has_work, self._update, self._run = schedule, has_work, update, run
        self.next: SchedulerOutput | None = None  # scheduled, not started
        self.last: tuple[SchedulerOutput, ModelRunnerOutput] | None = None  # run, not applied
        self._helper: ThreadPoolExecutor | None = None
        self.overlapped = 0  # steps that ran while the next one was being scheduled
        self.failed: str | None = None  # why every later call is refused

    def pending(self) -> bool:
        return self.next is not None or self.last is not None

    def step(self) -> list[Request]:
        """Run one step while the helper applies the one before and schedules the one after;
        the requests that made progress in the step applied."""
        self._check_not_failed()
        progressed = []
        if self.next is None:  # nothing scheduled ahead (the first step, or nothing could be)
            progressed = self._apply_last()
            if not self._has_work():
                return progressed
            self.next = self._schedule()
            if self.next is None:
                return progressed
        out, self.next = self.next, None
        if self._helper is None:
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="spmd-host")
        host = self._helper.submit(self._apply_and_schedule)
        try:
            result = self._run(out)
        except BaseException as exc:
            _wait_quietly(host)  # the helper must be done with the scheduler before the error goes up
            self._fail(f"step {out.step} failed: {type(exc).__name__}: {exc}")
            raise
        try:
            progressed += host.result()
        except BaseException as exc:
            self._fail(f"scheduling beside step {out.step} failed: {type(exc).__name__}: {exc}")
            raise EngineDeadError(f"engine failed while {self.failed}") from exc
        self.last = (out, result)
        self.overlapped += self.next is not None
        return progressed

    def _apply_and_schedule(self) -> list[Request]:
        progressed = self._apply_last()
        if self._has_work():  # one step is running: requests in it sampling are scheduled ahead
            self.next = self._schedule(in_flight=1, max_in_flight=2)
        return progressed

    def _apply_last(self) -> list[Request]:
        if self.last is None:
            return []
        (out, result), self.last = self.last, None
        return self._update(out, result)

    def drain(self) -> list[Request]:
        """Run what is scheduled and apply every output: afterwards nothing is pending."""
        self._check_not_failed()
        try:
            progressed = self._apply_last()
            if self.next is not None:
                out, self.next = self.next, None
                progressed += self._update(out, self._run(out))
        except BaseException as exc:
            self._fail(f"draining failed: {type(exc).__name__}: {exc}")
            raise
        return progressed

    def _fail(self, why: str) -> None:
        self.failed = self.failed or why
        self.next = self.last = None  # nothing pending is run or applied

    def _check_not_failed(self) -> None:
        if self.failed:
            raise EngineDeadError(f"engine failed earlier ({self.failed}): it serves nothing more")

    def shutdown(self) -> None:
        if self._helper is not None:
            self._helper.shutdown(wait=True)


def _wait_quietly(future) -> None:
    try:
        future.result()
    except BaseException:
        pass
