"""Pipeline stages that overlap: vLLM's batch queue under mp with PP > 1.

The scheduler part needs no processes: with steps in flight, their requests are
skipped, the steps hold disjoint requests, and a token that comes back for a
request preempted meanwhile is dropped. The engine part runs mp PP=2 (and
TP=2 x PP=2) and compares with uni, greedy and seeded, with two steps in flight.
"""

from __future__ import annotations

import pytest
from engine_helpers import make_tiny_checkpoint
from scheduler_helpers import drive, make, scheduler

from spmd_engine import LLM, SamplingParams
from spmd_engine.core.step_messages import ModelRunnerOutput


def reply(out, token=7):
    ids = [q.request_id for q in out.seqs if q.sample]
    return ModelRunnerOutput(ids, [token] * len(ids))


def test_steps_in_flight_hold_disjoint_halves_of_the_requests():
    s = scheduler()
    for rid in range(5):
        s.add_request(make(rid))
    a = s.schedule(in_flight=0, max_in_flight=2)
    b = s.schedule(in_flight=1, max_in_flight=2)
    assert [q.request_id for q in a.seqs] == ["0", "1", "2"]  # ceil(5 / 2)
    assert [q.request_id for q in b.seqs] == ["3", "4"]
    # Both in flight: nothing else can run, and no step is spent on it.
    assert s.schedule(in_flight=2, max_in_flight=2) is None
    s.update_from_output(a, reply(a))
    c = s.schedule(in_flight=1, max_in_flight=2)
    assert [(q.request_id, len(q.token_ids), q.context_len) for q in c.seqs] == [("0", 1, 3), ("1", 1, 3), ("2", 1, 3)]
    assert c.step == a.step + 2  # the None above did not count as a step


def test_finished_ids_held_back_by_an_empty_schedule_go_with_the_next_step():
    s = scheduler()
    for rid in range(2):
        s.add_request(make(rid, max_tokens=1))
    a = s.schedule(in_flight=0, max_in_flight=2)
    b = s.schedule(in_flight=1, max_in_flight=2)
    assert [q.request_id for q in a.seqs] == ["0"] and [q.request_id for q in b.seqs] == ["1"]
    assert [r.request_id for r in s.update_from_output(a, reply(a))] == ["0"]
    assert s.schedule(in_flight=1, max_in_flight=2) is None  # "1" is in flight, nothing waits
    assert [r.request_id for r in s.update_from_output(b, reply(b))] == ["1"]
    s.add_request(make(2))
    c = s.schedule(in_flight=0, max_in_flight=2)
    assert c.finished_request_ids == ["0", "1"]  # the runner still hears of "0"


def test_a_token_for_a_request_preempted_in_flight_is_dropped():
    # 2 blocks of 4 tokens: "0" (3-token prompt) and "1" fill them; "0" growing past its
    # block preempts the newest, "1", whose sampling step is still in flight.
    s = scheduler(num_blocks=2, block_size=4)
    s.add_request(make(0, prompt_len=4, max_tokens=4))
    s.add_request(make(1, prompt_len=3, max_tokens=4, first=20))
    a = s.schedule(in_flight=0, max_in_flight=2)  # both prompts, one block each
    assert [q.request_id for q in a.seqs] == ["0"]
    b = s.schedule(in_flight=1, max_in_flight=2)
    assert [q.request_id for q in b.seqs] == ["1"]
    s.update_from_output(a, reply(a, token=5))
    c = s.schedule(in_flight=1, max_in_flight=2)  # "0" needs a second block: "1" is preempted
    assert [q.request_id for q in c.seqs] == ["0"] and s.stats["preemptions"] == 1
    one = next(r for r in s.waiting if r.request_id == "1")
    s.update_from_output(b, reply(b, token=6))  # the stale token of the preempted step
    assert one.output_token_ids == []  # dropped: "1" is recomputed from its prompt
    assert not s._awaiting or all(rid != "1" for _, rid in s._awaiting)


def test_one_step_at_a_time_is_unchanged():
    # max_in_flight=1 (every executor but mp with PP > 1) schedules exactly as before.
    s = scheduler()
    for rid in range(4):
        s.add_request(make(rid))
    trace = drive(s)
    assert trace[0] == [(str(r), 3, 0, True) for r in range(4)]
    assert all(len(step) == 4 for step in trace)


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11], [12, 13, 14, 15], [16, 17, 18], [19, 20], [21]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def run(ckpt, params, **kwargs):
    with LLM(model=str(ckpt), max_model_len=32, seed=3, **kwargs) as llm:
        outs = llm.generate(PROMPTS, params)
        return [o.outputs[0].token_ids for o in outs], llm.get_stats()[0]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                                    SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=11)],
                         ids=["greedy", "seeded"])
def test_mp_pp2_with_two_steps_in_flight_matches_uni(ckpt, params):
    ref, ref_stats = run(ckpt, params, distributed_executor_backend="uni")
    tokens, stats = run(ckpt, params, pipeline_parallel_size=2, tensor_parallel_size=2)
    assert tokens == ref
    assert stats["peak_in_flight"] == 2 and ref_stats["peak_in_flight"] == 1
    # Two half batches alternate: about twice the steps, each with half the requests.
    assert stats["steps"] >= 2 * ref_stats["steps"] - 1


@pytest.mark.timeout(180)
def test_a_worker_death_with_two_steps_in_flight_fails_the_call_and_every_later_one(ckpt):
    # Steps in flight hold replies nobody has read: after the death the executor must refuse
    # every call (a later call would otherwise read a stale step reply as its own).
    import os
    import signal
    import time

    from spmd_engine.engine.core_client import EngineDeadError
    with LLM(model=str(ckpt), max_model_len=32, seed=3, pipeline_parallel_size=2) as llm:
        pids = llm.collective_rpc(lambda worker: os.getpid())
        killed: dict = {}

        def kill_last_stage(requests, tokens):
            if "at" not in killed:
                killed["at"] = time.monotonic()
                os.kill(pids[1], signal.SIGKILL)
        params = [SamplingParams(temperature=0.0, max_tokens=2 if i == 0 else 25, ignore_eos=True) for i in range(len(PROMPTS))]
        with pytest.raises(EngineDeadError):
            llm.generate(PROMPTS, params, progress=kill_last_stage)
        assert time.monotonic() - killed["at"] < 10
        with pytest.raises(EngineDeadError, match="Executor failed"):
            llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=2))
