"""Async scheduling (vLLM's `async_scheduling=True`): the engine schedules step k+1 while step
k runs, on uni (the worker on a step thread), mp and torchrun (external_launcher), and every
request gets what synchronous scheduling gives it: the same tokens, text, finish and stop
reasons, logprobs and prompt logprobs, whatever ends a request while its next step is in
flight (a stop string, a stop token, its length, an abort, a preemption).

The bundled model recites the Zen of Python with a byte tokenizer, so stop strings and
texts are known; the reference is the same engine with async_scheduling off.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from engine_helpers import make_tiny_checkpoint
from launch import run_torchrun

from spmd_engine import LLM, SamplingParams
from spmd_engine.config import ConfigError

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "tests" / "helpers" / "dist_scripts" / "async_scheduling.py"

PROMPTS = ["Beautiful is", "Explicit is", "Simple is better", "Flat", "Sparse is better than", "Readability",
           "Errors should never", "Now is better"]


def mixed_params() -> list[SamplingParams]:
    """One request for each way a request ends or is sampled."""
    return [
        SamplingParams(temperature=0.0, max_tokens=40, stop=["than"]),                      # a stop string mid-run
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[ord("b")]),           # a stop token
        SamplingParams(max_tokens=25, temperature=1.0, seed=3, logprobs=2),  # seeded sampling, logprobs
        SamplingParams(temperature=0.0, max_tokens=1),                                       # one token: nothing ahead
        SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.3, prompt_logprobs=1),
        SamplingParams(max_tokens=18, temperature=0.8, seed=5, n=2),
        SamplingParams(temperature=0.0, max_tokens=12, min_tokens=6, stop=["."], include_stop_str_in_output=True),
        SamplingParams(max_tokens=35, temperature=0.7, top_k=5, seed=11),
    ]


def summary(outputs, exact: bool = True) -> list:
    """What a request got. `exact=False` keeps each logprob entry's ids and ranks but not its
    value (`logprob_values` has those): outside batch-invariant mode a request's logits move
    in their last bits with the batch it shares, and async scheduling admits a waiting
    request one step later than synchronous scheduling can."""
    def entries(lp):
        if lp is None or exact:
            return lp
        return [e and {t: v.rank for t, v in e.items()} for e in lp]
    return [(entries(o.prompt_logprobs),
             [(c.token_ids, c.text, c.finish_reason, c.stop_reason, entries(c.logprobs),
               c.cumulative_logprob if exact else None) for c in o.outputs]) for o in outputs]


def logprob_values(outputs) -> list[float]:
    return [v.logprob for o in outputs for c in o.outputs for e in (c.logprobs or []) for v in e.values()]


def generate(async_scheduling: bool, **kw):
    """Batch-invariant mode: every value is the same bit for bit, whatever step admitted a request."""
    with LLM(**{"max_model_len": 128, "max_num_seqs": 3, "async_scheduling": async_scheduling,
                "batch_invariant": True, **kw}) as llm:
        got = summary(llm.generate(PROMPTS, mixed_params()))
        stats = llm.get_stats()
    return got, (stats[0] if isinstance(stats, list) else stats)


@pytest.mark.timeout(180)
def test_uni_outputs_equal_synchronous_scheduling():
    want, sync_stats = generate(False)
    got, stats = generate(True)
    assert got == want
    assert sync_stats["peak_in_flight"] == 1 and stats["peak_in_flight"] == 2
    finish = [c[2] for _, outs in got for c in outs]
    assert {"stop", "length"} <= set(finish)


@pytest.mark.timeout(180)
def test_uni_outputs_equal_synchronous_scheduling_under_preemption():
    """A KV cache of a few blocks: requests are preempted with their next step in flight."""
    per_token = 8 * 2 * 2 * 16 * 4  # layers x (K, V) x KV heads x head size x fp32
    tight = dict(kv_cache_memory_bytes=5 * 16 * per_token, block_size=16, max_model_len=64)  # 5 blocks
    want, sync_stats = generate(False, **tight)
    got, stats = generate(True, **tight)
    assert sync_stats["num_blocks"] == stats["num_blocks"] == 5
    assert stats["preemptions"] > 0 and stats["peak_in_flight"] == 2
    assert got == want
    assert stats["free_blocks"] == stats["num_blocks"]


@pytest.mark.timeout(120)
def test_uni_steps_run_in_the_callers_thread_while_a_helper_schedules_the_next():
    """The design (engine/overlapped_steps.py): torch's kernels stay on one thread (a second
    thread running them made every parallel region about 2x slower on 2 cores), and the
    scheduling of step k+1 happens while step k runs."""
    import threading
    import time
    with LLM(max_model_len=128, async_scheduling=True) as llm:
        core = llm.llm_engine.engine_core
        runner = core.model_executor.driver_worker.model_runner
        seen = {"step_threads": set(), "schedule_threads": set(), "overlaps": 0}
        running = threading.Event()
        execute, schedule = runner.execute_model, core.scheduler.schedule

        def timed_execute(out):
            seen["step_threads"].add(threading.get_ident())
            running.set()
            try:
                time.sleep(0.02)  # a forward long enough for the helper to schedule within it, a busy host too
                return execute(out)
            finally:
                running.clear()

        def watched_schedule(*args, **kwargs):
            seen["schedule_threads"].add(threading.get_ident())
            seen["overlaps"] += running.is_set()
            return schedule(*args, **kwargs)
        runner.execute_model, core.scheduler.schedule = timed_execute, watched_schedule
        llm.generate(PROMPTS[:3], [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * 3)
    assert seen["step_threads"] == {threading.get_ident()}
    assert seen["schedule_threads"] - seen["step_threads"]  # scheduled on the helper thread
    assert seen["overlaps"] >= 8  # while a step ran, not after it


def drive(llm, starts, abort_at=None, pause_at=2):
    """Requests added at steps `starts`, one aborted at `abort_at`, pause (keep) and resume at
    `pause_at`: steps are in flight at each. The final outputs by id."""
    engine, final, step = llm.llm_engine, {}, 0
    while step <= max(starts) or engine.has_unfinished_requests():
        for i, s in enumerate(starts):
            if s == step:
                engine.add_request(f"q{i}", PROMPTS[i], mixed_params()[i])
        if step == abort_at:
            engine.abort_request("q0")
        if step == pause_at:
            final.update({o.request_id: o for o in llm.pause_generation(mode="keep") if o.finished})
            llm.resume_generation()
        final.update({o.request_id: o for o in engine.step() if o.finished})
        step += 1
    return final


@pytest.mark.timeout(180)
def test_uni_online_steps_with_abort_and_pause_while_steps_are_in_flight():
    with LLM(max_model_len=128, async_scheduling=True) as llm:
        generated = llm.generate(PROMPTS[:3], mixed_params()[:3])
        want = summary(generated, exact=False)
        got = [drive(llm, [0, 1, 3])[f"q{i}"] for i in range(3)]
        assert summary(got, exact=False) == want
        assert logprob_values(got) == pytest.approx(logprob_values(generated), abs=1e-4)
        aborted = drive(llm, [0, 0, 0], abort_at=4)
        part = aborted["q0"].outputs[0]
        assert part.finish_reason == "abort" and 0 < len(part.token_ids) < len(want[0][1][0][0])
        assert part.token_ids == want[0][1][0][0][:len(part.token_ids)]
        stats = llm.get_stats()[0]
    assert stats["free_blocks"] == stats["num_blocks"] and stats["running"] == stats["waiting"] == 0


@pytest.mark.timeout(180)
def test_uni_abort_or_pause_then_sleep_with_a_step_scheduled_ahead():
    """A step scheduled ahead still names the requests an abort just finished: it runs (its
    tokens dropped) before the KV cache is given back, so the engine wakes clean."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    with LLM(max_model_len=128, async_scheduling=True, enable_sleep_mode=True) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params)]
        engine, core = llm.llm_engine, llm.llm_engine.engine_core
        for pause in (True, False):
            engine.add_request("a", PROMPTS[0], params)
            engine.add_request("b", PROMPTS[1], params)
            for _ in range(4):
                engine.step()
            assert core.has_unfinished_requests()
            if pause:
                outs = llm.pause_generation(mode="abort")
                assert sorted((o.request_id, o.outputs[0].finish_reason) for o in outs) == [("a", "abort"),
                                                                                             ("b", "abort")]
                assert not core.has_unfinished_requests()  # nothing left scheduled ahead
            else:
                engine.abort_request(["a", "b"])
                assert core.has_unfinished_requests()  # the step scheduled ahead
            llm.sleep(1)
            llm.wake_up()
            if pause:
                llm.resume_generation()
            assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params)] == want


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_mp_tp2_outputs_equal_synchronous_scheduling(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "tiny", seed=0)
    prompts = [list(range(1, 30)), [4, 5, 6, 7, 8], [9, 10, 11], [3] * 20]
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[7]),
              SamplingParams(max_tokens=9, temperature=1.0, seed=2, logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=1)]
    results = {}
    for flag in (False, True):
        with LLM(model=str(ckpt), seed=0, tensor_parallel_size=2, timeout_s=60, max_num_seqs=2,
                 async_scheduling=flag) as llm:
            outs = llm.generate(prompts, params)
            results[flag] = summary(outs, exact=False), logprob_values(outs)
            results[flag, "peak"] = llm.get_stats()[0]["peak_in_flight"]
    assert results[True][0] == results[False][0]
    assert results[True][1] == pytest.approx(results[False][1], abs=1e-4)
    assert (results[False, "peak"], results[True, "peak"]) == (1, 2)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.xdist_group("world4")
def test_torchrun_tp2_dp2_outputs_equal_synchronous_scheduling(tmp_path):
    """external_launcher: each rank's engine schedules ahead and its worker steps on a thread;
    the online loop exchanges between the TP ranks at every step, with a step in flight."""
    launch = run_torchrun(4, [SCRIPT, tmp_path], timeout=280,
                          env_extra={"OMP_NUM_THREADS": "1", "SPMD_ENGINE_TIMEOUT_S": "60"})
    assert launch.returncode == 0 and not launch.timed_out, launch.describe()
    assert not launch.leftover_pids
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert len(results) == 4
    for r in results:
        assert r["async_generate"] == r["sync_generate"], r["rank"]
        assert r["async_online"] == r["sync_generate"], r["rank"]
        assert (r["sync_peak"], r["async_peak"]) == (1, 2)
    for replica in (0, 1):
        ranks = [r for r in results if r["replica"] == replica]
        assert len(ranks) == 2 and ranks[0]["async_generate"] == ranks[1]["async_generate"]


def test_pipeline_parallelism_is_refused_with_one_line():
    with pytest.raises(ConfigError, match=r"async scheduling is not supported with pipeline parallelism "
                                          r"\(pipeline_parallel_size=2\)"):
        LLM(pipeline_parallel_size=2, async_scheduling=True)
    run = subprocess.run([sys.executable, "-m", "spmd_engine.run", "--prompt", "Beautiful is", "-pp", "2",
                          "--async-scheduling"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.startswith("error: --async-scheduling: async scheduling is not supported"), run.stderr
    assert run.stderr.count("\n") == 1
