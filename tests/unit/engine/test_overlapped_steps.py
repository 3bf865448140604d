"""OverlappedSteps (async scheduling in the engine's own thread) after a failure: of the step,
or of the helper's work beside it. Either way the scheduler and the worker no longer agree on
what ran, so every later call is refused instead of stepping on from that state."""

from __future__ import annotations

import pytest

from spmd_engine.core.step_messages import ModelRunnerOutput, SchedulerOutput
from spmd_engine.engine.core_client import EngineDeadError
from spmd_engine.engine.overlapped_steps import OverlappedSteps


class Fake:
    """A scheduler with `steps` steps of work and a runner; either may be told to fail at a step."""

    def __init__(self, steps: int, run_fails_at: int = 0, update_fails_at: int = 0):
        self.left, self.scheduled, self.ran, self.applied = steps, 0, [], []
        self.run_fails_at, self.update_fails_at = run_fails_at, update_fails_at

    def schedule(self, in_flight: int = 0, max_in_flight: int = 1):
        self.scheduled += 1
        self.left -= 1
        return SchedulerOutput(self.scheduled, [], [], [])

    def has_work(self) -> bool:
        return self.left > 0

    def update(self, out, result):
        if out.step == self.update_fails_at:
            raise RuntimeError("update failed")
        self.applied.append(out.step)
        return []

    def run(self, out):
        if out.step == self.run_fails_at:
            raise EngineDeadError(f"engine failed while running step {out.step}: boom")
        self.ran.append(out.step)
        return ModelRunnerOutput([], [])

    def steps(self) -> OverlappedSteps:
        return OverlappedSteps(self.schedule, self.has_work, self.update, self.run)


def run_all(steps: OverlappedSteps) -> None:
    while steps.pending() or steps._has_work():
        steps.step()
    steps.shutdown()


def test_every_step_runs_once_and_is_applied_in_order():
    fake = Fake(6)
    steps = fake.steps()
    run_all(steps)
    assert fake.ran == fake.applied == [1, 2, 3, 4, 5, 6]
    assert steps.overlapped == 5  # every step but the last ran while the next was scheduled


@pytest.mark.parametrize("where", ["run", "update"])
def test_after_a_failure_every_later_call_is_refused(where):
    fake = Fake(6, **{f"{where}_fails_at": 3})
    steps = fake.steps()
    with pytest.raises(EngineDeadError):
        run_all(steps)
    ran = list(fake.ran)
    for call in (steps.step, steps.drain):
        with pytest.raises(EngineDeadError, match="engine failed earlier"):
            call()
    assert fake.ran == ran and not steps.pending()  # nothing ran or was applied afterwards
    steps.shutdown()
