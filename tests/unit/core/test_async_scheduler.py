"""Async scheduling in the scheduler (vLLM's async_scheduling): step k+1 is scheduled before
step k's tokens are known, with placeholders the runner fills in, and no request's tokens change.

The fake runner below stands in for a model the way the engine uses one: it keeps each
request's KV (the token at every position it has computed, rewritten after preemption),
fills PLACEHOLDER_TOKEN_ID from the token it sampled last for that request, and samples a
token that depends on the whole KV prefix, so a wrong input or position changes every later
token. The async driver keeps two steps in flight as EngineCore does.
"""

from __future__ import annotations

import hashlib
from collections import deque

from scheduler_helpers import EOS

from spmd_engine.config import SchedulerConfig
from spmd_engine.core.kv_cache_manager import KVCacheManager
from spmd_engine.core.request import Request
from spmd_engine.core.scheduler import Scheduler
from spmd_engine.core.step_messages import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput
from spmd_engine.sampling_params import SamplingParams


class FakeRunner:
    def __init__(self, eos_every: int = 0, block_size: int = 4):
        self.block_size = block_size
        self.blocks: dict[int, dict[int, int]] = {}  # the KV cache: block id -> offset -> token
        self.tables: dict[str, list[int]] = {}
        self.last_sampled: dict[str, int] = {}
        self.eos_every = eos_every
        self.placeholders = 0

    def run(self, out) -> ModelRunnerOutput:
        bs = self.block_size
        for rid in out.finished_request_ids:
            self.tables.pop(rid, None)
            self.last_sampled.pop(rid, None)
        ids, tokens = [], []
        for s in out.seqs:
            if s.new_block_table:
                self.tables[s.request_id] = list(s.block_ids)
            else:
                self.tables[s.request_id] += s.block_ids
            table = self.tables[s.request_id]
            for i, t in enumerate(s.token_ids):
                if t == PLACEHOLDER_TOKEN_ID:
                    self.placeholders += 1
                    t = self.last_sampled[s.request_id]
                p = s.context_len + i
                self.blocks.setdefault(table[p // bs], {})[p % bs] = t
            if s.sample:  # KeyError: a position never written
                prefix = [self.blocks[table[p // bs]][p % bs] for p in range(s.context_len + len(s.token_ids))]
                digest = hashlib.sha256(repr(prefix).encode()).digest()
                token = EOS if self.eos_every and digest[0] % self.eos_every == 0 else digest[1] % 50
                self.last_sampled[s.request_id] = token
                ids.append(s.request_id)
                tokens.append(token)
        return ModelRunnerOutput(ids, tokens)


def make_scheduler(async_scheduling: bool, num_blocks=64, block_size=4, budget=None, max_model_len=40):
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget,
                             async_scheduling=async_scheduling).resolve(max_model_len, block_size)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, True), EOS)


def requests():
    out = []
    for i in range(9):
        prompt = [(i * 7 + j) % 40 + 1 for j in range(2 + (i * 5) % 13)]
        params = SamplingParams(temperature=0.0, max_tokens=1 + (i * 3) % 9, ignore_eos=i % 4 == 0)
        out.append(Request(str(i), prompt, params, seed=i))
    return out


def run(async_scheduling: bool, **kw):
    """Every request's tokens and finish reason, the scheduler's stats, the runner, and the
    most steps ever in flight."""
    s, runner = make_scheduler(async_scheduling, **{k: v for k, v in kw.items() if k != "eos_every"}), \
        FakeRunner(kw.get("eos_every", 0))
    reqs = requests()
    for r in reqs:
        s.add_request(r)
    limit = 2 if async_scheduling else 1
    in_flight: deque = deque()
    peak = 0
    while s.has_unfinished() or in_flight:
        if len(in_flight) < limit and s.has_unfinished():
            out = s.schedule(in_flight=len(in_flight), max_in_flight=limit)
            if out is not None:
                in_flight.append(out)
                peak = max(peak, len(in_flight))
                if len(in_flight) < limit:
                    continue
        out = in_flight.popleft()  # the runner runs steps in the order they were sent
        s.update_from_output(out, runner.run(out))
    result = [(r.output_token_ids, r.finish_reason) for r in reqs]
    return result, s, runner, peak


def test_a_sampling_request_is_scheduled_again_before_its_token_is_known():
    s = make_scheduler(True)
    s.add_request(Request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4), seed=0))
    first = s.schedule()
    second = s.schedule(in_flight=1, max_in_flight=2)
    (seq,) = second.seqs
    assert (seq.token_ids, seq.context_len, seq.sample) == ([PLACEHOLDER_TOKEN_ID], 3, True)
    assert first.seqs[0].sample and s.running[0].num_output_placeholders == 2
    s.update_from_output(first, ModelRunnerOutput(["a"], [11]))
    assert s.running[0].output_token_ids == [11] and s.running[0].num_output_placeholders == 1


def test_not_scheduled_ahead_of_a_token_that_may_end_it_by_length():
    s = make_scheduler(True)
    s.add_request(Request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=1), seed=0))
    s.schedule()
    assert s.schedule(in_flight=1, max_in_flight=2) is None  # its only token is in flight
    s = make_scheduler(True, max_model_len=4)
    s.add_request(Request("b", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=9), seed=0))
    s.schedule()
    assert s.schedule(in_flight=1, max_in_flight=2) is None  # that token fills max_model_len


def test_without_async_scheduling_a_request_in_flight_waits():
    s = make_scheduler(False)
    s.add_request(Request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4), seed=0))
    s.schedule()
    assert s.schedule(in_flight=1, max_in_flight=2) is None and s.running[0].num_output_placeholders == 0


def test_tokens_equal_synchronous_scheduling_with_eos_and_chunked_prompts():
    sync, _, _, peak_sync = run(False, eos_every=7, budget=8)
    got, s, runner, peak = run(True, eos_every=7, budget=8)
    assert got == sync
    assert peak_sync == 1 and peak == 2 and runner.placeholders > 10
    assert any(reason == "stop" for _, reason in got)  # EOS ended some while their next step was in flight
    assert any(reason == "length" for _, reason in got)
    assert s.kv.num_free_blocks == s.kv.pool.num_blocks


def test_tokens_equal_synchronous_scheduling_under_preemption():
    sync, s_sync, _, _ = run(False, num_blocks=9)
    got, s, runner, _ = run(True, num_blocks=9)
    assert got == sync
    assert s.stats["preemptions"] > 0 and runner.placeholders > 0
    assert s.kv.num_free_blocks == s.kv.pool.num_blocks


def test_a_request_aborted_with_a_step_in_flight_frees_its_blocks_and_drops_the_token():
    s, runner = make_scheduler(True), FakeRunner()
    a = Request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=8), seed=0)
    s.add_request(a)
    first = s.schedule()
    second = s.schedule(in_flight=1, max_in_flight=2)
    s.update_from_output(first, runner.run(first))
    s.abort_requests(["a"])
    assert s.kv.num_free_blocks == s.kv.pool.num_blocks
    s.update_from_output(second, runner.run(second))  # its token comes back for nobody
    assert len(a.output_token_ids) == 1 and a.finish_reason == "abort"
    assert not s.has_unfinished() and s.schedule() is not None  # the runner is told it finished
