"""The online engine API (issue 21) in one process: `llm.llm_engine` add_request / step /
abort_request, the three output kinds, multi-turn prefix hits, pause / resume, resetting
running requests after a weight update, metrics, and bad input.

References: `generate` on a second engine (itself a loop over the same API, so the
staggered schedule is what differs), a fresh engine given the new weights, the block
arithmetic of num_cached_tokens, and the pool's free-block count.
"""

from __future__ import annotations

import pytest
from engine_helpers import make_tiny_checkpoint, reference_greedy
from safetensors.torch import load_file

from spmd_engine import LLM, RequestOutputKind, SamplingParams

PROMPTS = [list(range(1, 40)), [4, 5, 6, 7, 8], [9, 10, 11], list(range(50, 70))]
N = 12


def params(kind=RequestOutputKind.CUMULATIVE, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": N, "ignore_eos": True, "output_kind": kind, **kw})


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return (make_tiny_checkpoint(tmp_path_factory.mktemp("old"), seed=0),
            make_tiny_checkpoint(tmp_path_factory.mktemp("new"), seed=1))


@pytest.fixture(scope="module")
def llm(ckpts):
    with LLM(model=str(ckpts[0]), distributed_executor_backend="uni", seed=0, max_num_seqs=3) as llm:
        yield llm


def run_staggered(engine, requests, start_steps):
    """Add request i at step start_steps[i]; step until done; every output per id, in order."""
    outputs, step = {}, 0
    pending = sorted(zip(start_steps, range(len(requests))))
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, i = pending.pop(0)
            engine.add_request(*requests[i])
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        step += 1
    return outputs


def test_step_outputs_equal_generate_greedy_and_seeded(llm):
    sampled = SamplingParams(max_tokens=N, ignore_eos=True, temperature=1.0, seed=11)
    mixed = [SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True), sampled] * 2
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, mixed)]
    requests = [(f"r{i}", p, params(seed=11, temperature=1.0) if i % 2 else params())
                for i, p in enumerate(PROMPTS)]
    outs = run_staggered(llm.llm_engine, requests, [0, 2, 3, 7])  # max_num_seqs=3: one waits
    assert [outs[f"r{i}"][-1].outputs[0].token_ids for i in range(4)] == want
    for i in range(4):  # CUMULATIVE: one output per token, each a prefix of the next
        seen = [o.outputs[0].token_ids for o in outs[f"r{i}"]]
        assert seen == [want[i][:k] for k in range(1, N + 1)]
        assert [o.finished for o in outs[f"r{i}"]] == [False] * (N - 1) + [True]


def test_delta_and_final_only(llm):
    want = llm.generate(PROMPTS[:2], params())
    outs = run_staggered(llm.llm_engine, [("d", PROMPTS[0], params(RequestOutputKind.DELTA, n=2)),
                                          ("f", PROMPTS[1], params(RequestOutputKind.FINAL_ONLY))], [0, 1])
    assert len(outs["f"]) == 1 and outs["f"][0].outputs[0].token_ids == want[1].outputs[0].token_ids
    for k in range(2):  # greedy: both samples are the same tokens, delivered one at a time
        pieces = [c.token_ids for o in outs["d"] for c in o.outputs if c.index == k]
        assert all(len(p) == 1 for p in pieces) and sum(pieces, []) == want[0].outputs[0].token_ids


def test_abort_returns_the_tokens_so_far_once_and_frees_blocks(llm):
    full = llm.generate(PROMPTS[:2], params())
    engine, core = llm.llm_engine, llm.llm_engine.engine_core
    free_before = core.scheduler.kv.num_free_blocks
    engine.add_request("a", PROMPTS[0], params())
    engine.add_request("b", PROMPTS[1], params())
    for _ in range(5):
        engine.step()
    engine.abort_request("a")
    assert core.scheduler.kv.blocks_of("0") == []  # the engine id of "a": its blocks went back
    (aborted,) = [o for o in engine.step() if o.request_id == "a"]
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert aborted.outputs[0].token_ids == full[0].outputs[0].token_ids[:5]
    rest = run_staggered(engine, [], [])
    assert "a" not in rest and rest["b"][-1].outputs[0].token_ids == full[1].outputs[0].token_ids
    assert core.scheduler.kv.num_free_blocks == free_before
    engine.abort_request(["a", "never-added"])  # finished or unknown ids: a no-op, as vLLM
    assert engine.step() == []


def test_pause_keep_resume_equals_an_uninterrupted_run(llm):
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params())]
    engine = llm.llm_engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"k{i}", p, params())
    for _ in range(4):
        engine.step()
    assert llm.pause_generation(mode="keep") == [] and llm.is_paused()
    with pytest.raises(RuntimeError, match="already paused"):
        llm.pause_generation(mode="abort")
    with pytest.raises(RuntimeError, match="step\\(\\) while generation is paused"):
        engine.step()
    llm.resume_generation()
    llm.resume_generation()  # not paused: a no-op, as vLLM
    outs = run_staggered(engine, [], [])
    assert [outs[f"k{i}"][-1].outputs[0].token_ids for i in range(4)] == want


def test_pause_abort_and_wait(llm):
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params())]
    engine = llm.llm_engine
    engine.add_request("x", PROMPTS[0], params())
    engine.add_request("y", PROMPTS[1], params())
    engine.step(), engine.step(), engine.step()
    partial = llm.pause_generation(mode="abort", clear_cache=True)
    assert {o.request_id: o.outputs[0].token_ids for o in partial} == {"x": want[0][:3], "y": want[1][:3]}
    assert all(o.outputs[0].finish_reason == "abort" for o in partial) and not engine.has_unfinished_requests()
    assert llm.get_stats()[0]["cached_blocks"] == 0
    llm.resume_generation()
    engine.add_request("z", PROMPTS[1], params())
    engine.step()
    finished = [o for o in llm.pause_generation(mode="wait") if o.finished]
    assert [o.outputs[0].token_ids for o in finished] == [want[1]]
    llm.resume_generation()
    with pytest.raises(ValueError, match="mode must be one of"):
        llm.pause_generation(mode="freeze")


def test_multi_turn_counts_cached_tokens_and_equals_a_cold_decode(llm, ckpts):
    block = llm.config.cache_config.block_size
    engine, prompt, turns = llm.llm_engine, list(range(100, 129)), []
    for turn in range(3):
        engine.add_request(f"t{turn}", prompt, params(RequestOutputKind.FINAL_ONLY))
        (out,) = run_staggered(engine, [], [])[f"t{turn}"]
        turns.append((list(prompt), out))
        prompt = prompt + out.outputs[0].token_ids + [7, 8, 9]  # the tool's answer
    assert turns[0][1].num_cached_tokens == 0
    for (p0, o0), (_, o1) in zip(turns, turns[1:]):
        assert o1.num_cached_tokens == (len(p0) + N) // block * block > 0
        assert o1.metrics.num_cached_tokens == o1.num_cached_tokens
    assert [o.outputs[0].token_ids for _, o in turns] == [reference_greedy(ckpts[0], p, N) for p, _ in turns]


def test_metrics(llm):
    before = {m.name: m for m in llm.get_metrics()}
    outs = llm.generate(PROMPTS[:2], params())
    m = outs[0].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert (m.num_prompt_tokens, m.num_generation_tokens) == (len(PROMPTS[0]), N)
    after = {m.name: m for m in llm.get_metrics()}
    delta = lambda name: after[name].value - before[name].value  # noqa: E731
    assert delta("vllm:generation_tokens") == 2 * N
    assert delta("vllm:prompt_tokens") == len(PROMPTS[0]) + len(PROMPTS[1])
    ttft = after["vllm:time_to_first_token_seconds"]
    assert ttft.count - before["vllm:time_to_first_token_seconds"].count == 2
    assert after["vllm:inter_token_latency_seconds"].count - before["vllm:inter_token_latency_seconds"].count == 2 * (N - 1)
    assert 0 <= after["vllm:prefix_cache_hit_rate"].value <= 1


def test_bad_input(llm):
    engine = llm.llm_engine
    engine.add_request("dup", PROMPTS[1], params())
    with pytest.raises(ValueError, match="'dup' is already running"):
        engine.add_request("dup", PROMPTS[2], params())
    with pytest.raises(TypeError, match="request_id must be a str"):
        engine.add_request(3, PROMPTS[2], params())
    with pytest.raises(RuntimeError, match="generate while 1 requests"):
        llm.generate(PROMPTS[:1], params())
    run_staggered(engine, [], [])
    engine.add_request("dup", PROMPTS[1], params())  # finished: the id may be used again
    run_staggered(engine, [], [])
    with pytest.raises(ValueError, match="reset_running_requests must be True or False"):
        llm.reset_prefix_cache(reset_running_requests="yes")
    with pytest.raises(Exception, match="admission must be one of"):
        LLM(distributed_executor_backend="uni", admission="rank1")
    with pytest.raises(Exception, match="output_kind must be a RequestOutputKind"):
        SamplingParams(temperature=0.0, output_kind="delta")


def test_zz_weight_update_mid_rollout_recomputes_running_requests(llm, ckpts):
    """Last in the file: it leaves the module's engine on the first checkpoint's weights again."""
    old, new = ckpts
    cut, engine = 5, llm.llm_engine

    def rollout_across_an_update(weights_dir, reset: bool, version):
        ids = [f"w{version}{i}" for i in range(2)]
        for rid, p in zip(ids, PROMPTS):
            engine.add_request(rid, p, params())
        for _ in range(cut):
            engine.step()
        llm.pause_generation(mode="keep")
        llm.start_weight_update()
        llm.collective_rpc("load_weights", args=(list(load_file(str(weights_dir / "model.safetensors")).items()),))
        llm.finish_weight_update(version)
        if reset:
            assert llm.reset_prefix_cache() is False  # vLLM's rule: running requests hold blocks
            assert llm.reset_prefix_cache(reset_running_requests=True) is True
        llm.resume_generation()
        outs = run_staggered(engine, [], [])
        return [outs[rid][-1] for rid in ids]

    got = rollout_across_an_update(new, reset=True, version=1)
    assert [o.weight_version for o in got] == [1, 1]  # the version they finished under
    for o, p in zip(got, PROMPTS):
        head = o.outputs[0].token_ids[:cut]
        assert o.outputs[0].token_ids[cut:] == reference_greedy(new, p + head, N - cut)
    # Control: without the reset the KV kept from the other weights changes the continuation.
    stale = rollout_across_an_update(old, reset=False, version=2)[0].outputs[0].token_ids
    assert stale[cut:] != reference_greedy(old, PROMPTS[0] + stale[:cut], N - cut)
