"""ModelRunner from inside, on one rank (SoloGroup) and a tiny checkpoint, driven by SchedulerOutputs
written by hand (no scheduler, no executor): the tokens of a chunked prefill and of the decode
steps after it equal a decode that recomputes the whole sequence every step, two requests batched
give each its own tokens, and a request's state survives a sleep it is kept through."""

import pytest
import torch
from engine_helpers import make_tiny_checkpoint, reference_greedy

from spmd_engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from spmd_engine.core.step_messages import NewRequestData, ScheduledSeq, SchedulerOutput
from spmd_engine.model.solo import SoloGroup
from spmd_engine.sampling_params import SamplingParams
from spmd_engine.worker.model_runner import ModelRunner

BLOCK = 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("runner"), seed=11)


@pytest.fixture
def runner(ckpt):
    config = EngineConfig(model_config=ModelConfig(model=str(ckpt), dtype="float32"),
                          parallel_config=ParallelConfig(), scheduler_config=SchedulerConfig(),
                          cache_config=CacheConfig(block_size=BLOCK), seed=0, device="cpu", timeout_s=60)
    config.scheduler_config.resolve(64, BLOCK)
    runner = ModelRunner(config, torch.device("cpu"), SoloGroup(), SoloGroup())
    runner.load_model()
    runner.initialize_kv_cache(32)
    return runner


class Driver:
    """Plays the scheduler for a few requests: their blocks, positions and steps."""

    def __init__(self, runner):
        self.runner, self.step, self.next_block = runner, 0, 0
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.blocks: dict[str, list[int]] = {}

    def add(self, rid, prompt):
        self.tokens[rid], self.computed[rid], self.blocks[rid] = list(prompt), 0, []
        return NewRequestData(rid, SamplingParams(temperature=0.0, max_tokens=64), 0, len(prompt))

    def seq(self, rid, count):
        done = self.computed[rid]
        needed = -(-(done + count) // BLOCK) - len(self.blocks[rid])
        new_blocks = list(range(self.next_block, self.next_block + needed))
        self.next_block += needed
        first = not self.blocks[rid]
        self.blocks[rid] += new_blocks
        ids = self.tokens[rid][done:done + count]
        self.computed[rid] += count
        return ScheduledSeq(rid, ids, done, self.blocks[rid] if first else new_blocks, first,
                            sample=self.computed[rid] == len(self.tokens[rid]))

    def run(self, seqs, new=()):
        self.step += 1
        out = self.runner.execute_model(SchedulerOutput(self.step, seqs, list(new), []))
        out = out if out is not None else self.runner.sample_tokens()
        for rid, token in zip(out.request_ids, out.sampled_token_ids):
            self.tokens[rid].append(token)
        return dict(zip(out.request_ids, out.sampled_token_ids))


def test_chunked_prefill_then_decode_equals_a_full_recompute(runner, ckpt):
    prompt = [3, 9, 27, 81, 43, 5, 15, 45, 7]
    d = Driver(runner)
    new = d.add("a", prompt)
    assert d.run([d.seq("a", 4)], [new]) == {}  # a prompt chunk samples nothing
    assert d.run([d.seq("a", 5)]) != {}
    for _ in range(5):
        d.run([d.seq("a", 1)])
    assert d.tokens["a"][len(prompt):] == reference_greedy(ckpt, prompt, 6)


def test_two_requests_in_one_step_each_get_their_own_tokens(runner, ckpt):
    p, q = [1, 2, 3, 4, 5], [60, 61]
    d = Driver(runner)
    news = [d.add("p", p), d.add("q", q)]
    d.run([d.seq("p", len(p)), d.seq("q", len(q))], news)
    for _ in range(3):
        d.run([d.seq("p", 1), d.seq("q", 1)])
    assert d.tokens["p"][len(p):] == reference_greedy(ckpt, p, 4)
    assert d.tokens["q"][len(q):] == reference_greedy(ckpt, q, 4)


def test_a_request_kept_through_a_sleep_goes_on_after_its_kv_is_recomputed(runner, ckpt):
    prompt = [8, 6, 7, 5, 3, 0, 9]
    d = Driver(runner)
    new = d.add("k", prompt)
    d.run([d.seq("k", len(prompt))], [new])
    d.run([d.seq("k", 1)])
    runner.sleep(1)
    runner.wake_up(["weights", "kv_cache"])
    # Resumed as after a preemption: every known token again, into a new block table.
    d.computed["k"], d.blocks["k"] = 0, []
    d.run([d.seq("k", len(d.tokens["k"]))])
    d.run([d.seq("k", 1)])
    assert d.tokens["k"][len(prompt):] == reference_greedy(ckpt, prompt, 4)
