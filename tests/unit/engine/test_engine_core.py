"""EngineCore from inside, over a CountingExecutor (tests/helpers/fake_executor.py): what it sends
the workers each step, how requests finish, and that a worker error leaves it refusing."""

import pytest
from fake_executor import VOCAB, CountingExecutor, counting_config

from spmd_engine.core.request import Request
from spmd_engine.engine.core import EngineCore
from spmd_engine.engine.core_client import EngineDeadError
from spmd_engine.sampling_params import SamplingParams


def make_core(tmp_path, executor=CountingExecutor, **scheduler):
    return EngineCore(counting_config(tmp_path, **scheduler), executor, max_model_len=256, eos_token_id=None)


def request(rid, prompt, max_tokens=5):
    return Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), seed=0)


def test_requests_finish_with_the_executors_tokens_and_the_blocks_come_back(tmp_path):
    core = make_core(tmp_path)
    core.add_request(request("a", [1, 2, 3], max_tokens=4))
    core.add_request(request("b", [50], max_tokens=2))
    done = {}
    while core.scheduler.has_unfinished():
        for r in core.step():
            if r.finish_reason is not None:
                done[r.request_id] = r
    assert done["a"].output_token_ids == [4, 5, 6, 7] and done["a"].finish_reason == "length"
    assert done["b"].output_token_ids == [51, 52]
    kv = core.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks  # every block returned
    first = core.executor.steps[0]
    assert {n.request_id for n in first.new_requests} == {"a", "b"}  # settings travel once
    assert not any(s.new_requests for s in core.executor.steps[1:])


def test_a_chunked_prompt_samples_only_when_its_prompt_is_done(tmp_path):
    core = make_core(tmp_path, max_num_batched_tokens=4, enable_chunked_prefill=True)
    core.add_request(request("long", list(range(10)), max_tokens=1))
    while core.scheduler.has_unfinished():
        core.step()
    samples = [s.sample for out in core.executor.steps for s in out.seqs]
    assert samples == [False, False, True]  # 4 + 4 + 2 prompt tokens
    assert core.executor.last_token["long"] == 9


def test_a_worker_error_fails_the_step_and_every_later_call(tmp_path):
    class FailsAtStep2(CountingExecutor):
        fail_at_step = 2
    core = make_core(tmp_path, executor=FailsAtStep2)
    core.add_request(request("a", [1, 2]))
    core.step()
    with pytest.raises(EngineDeadError, match="engine failed while running step 2: worker failed at step 2"):
        core.step()
    core.add_request(request("b", [7]))  # a new request is not served from what is left
    with pytest.raises(EngineDeadError, match="executor failed earlier"):
        core.step()


def test_sleep_refuses_while_blocks_are_held_and_forgets_the_prefix_cache(tmp_path):
    core = make_core(tmp_path)
    core.add_request(request("a", [1, 2, 3, 4, 5], max_tokens=3))
    core.step()
    with pytest.raises(RuntimeError, match="cannot sleep: 1 requests unfinished"):
        core.sleep(1)
    while core.scheduler.has_unfinished():
        core.step()
    core.sleep(1)
    assert core.executor.is_sleeping and ("sleep", (1,)) in core.executor.rpcs
    core.wake_up(["weights", "kv_cache"])
    assert not core.executor.is_sleeping
    assert VOCAB == 100
