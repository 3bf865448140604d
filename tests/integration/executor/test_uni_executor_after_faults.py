"""After a step raises in the engine's own process (uni), every later call is refused.

The step stopped halfway: its KV writes, the sampler's streams and the runner's block
tables are in an unknown state. Before, a later generate ran on that state (and died on a
misleading "the KV cache is too small"). Now the executor fails as mp's does after a
worker error, naming the step that raised; under async scheduling the engine's overlapped
steps refuse first (engine/overlapped_steps.py), and the step scheduled ahead never runs.
"""

from __future__ import annotations

import pytest

from spmd_engine import LLM, SamplingParams
from spmd_engine.engine.core_client import EngineDeadError


def fail_the_fifth_step(worker):
    runner = worker.model_runner
    run = runner.execute_model
    runner.steps_entered = 0

    def execute_model(out):
        runner.steps_entered += 1
        if runner.steps_entered == 5:
            raise RuntimeError("injected fault")
        return run(out)
    runner.execute_model = execute_model


@pytest.mark.timeout(120)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_step_that_raises_fails_every_later_call(async_scheduling):
    with LLM(max_model_len=64, async_scheduling=async_scheduling) as llm:
        llm.collective_rpc(fail_the_fifth_step)
        with pytest.raises(EngineDeadError, match="injected fault"):
            llm.generate(["Beautiful is"], SamplingParams(temperature=0.0, max_tokens=20))
        entered = llm.llm_engine.model_executor.driver_worker.model_runner.steps_entered
        assert entered == 5  # nothing ran after the failed step
        refusal = (r"engine failed earlier \(step 5 failed: .*injected fault\)" if async_scheduling
                   else r"Executor failed. \(step 5 raised RuntimeError: injected fault\)")
        with pytest.raises(EngineDeadError, match=refusal):
            llm.generate(["Beautiful is"], SamplingParams(temperature=0.0, max_tokens=5))
        with pytest.raises(RuntimeError, match="Executor failed"):
            llm.collective_rpc("get_runner_stats")
