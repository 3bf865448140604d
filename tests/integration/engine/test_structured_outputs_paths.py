"""Structured outputs on engines of their own (one uni engine per process at a time, so apart
from test_structured_outputs.py's shared one): a byte-level BPE tokenizer (multi-byte tokens,
so the mask is not per character), preemption, prefix-cache hits and async scheduling changing
no token, batch-invariant mode giving a request the same bits alone and batched."""

from __future__ import annotations

import json

import pytest
from chat_checkpoint import make_chat_checkpoint
from structured import check_samples, structured_params

from spmd_engine import LLM
from spmd_engine.model.tokenizer import load_tokenizer

pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    ckpt = make_chat_checkpoint(tmp_path_factory.mktemp("bpe"))
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["eos_token_id"] = 1  # "</s>": the model's EOS is the tokenizer's
    (ckpt / "config.json").write_text(json.dumps(cfg))
    return ckpt  # each test opens its engine (one uni engine per process at a time)


def test_every_constraint_holds_with_multi_byte_bpe_tokens(bpe):
    tokenizer = load_tokenizer(bpe)
    with LLM(model=str(bpe), seed=0, max_model_len=256) as llm:
        check_samples(llm, bpe, "Beautiful is", 16, names=("json", "date", "choice", "grammar"))
        out = llm.generate("Beautiful is", structured_params("json", 0))[0].outputs[0]
    lengths = [len(tokenizer.decode([t]).encode()) for t in out.token_ids]
    assert max(lengths) > 1, "the mask was only ever tested one character at a time"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_200_samples_per_constraint_with_bpe_tokens(bpe):
    with LLM(model=str(bpe), seed=0, max_model_len=256) as llm:
        check_samples(llm, bpe, "Beautiful is", 200)


def test_preemption_prefix_hits_and_async_scheduling_change_no_token(tmp_path):
    prompts = ["Beautiful is better than ugly. Explicit is", "Beautiful is better than ugly. Simple is"] * 3
    params = [structured_params("json", s) for s in range(6)]
    with LLM(seed=0, max_model_len=256) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        again = llm.generate(prompts, params)  # the prompts' full blocks now come from the prefix cache
        assert [o.outputs[0].token_ids for o in again] == reference
        assert all(o.num_cached_tokens > 0 for o in again)
    per_token = 8 * 2 * 2 * 16 * 4  # layers x (K, V) x KV heads x head size x fp32
    with LLM(seed=0, max_model_len=256, kv_cache_memory_bytes=16 * 16 * per_token, block_size=16) as small:
        assert [o.outputs[0].token_ids for o in small.generate(prompts, params)] == reference
        assert small.get_stats()[0]["preemptions"] > 0
    with LLM(seed=0, max_model_len=256, async_scheduling=True) as overlapped:
        assert [o.outputs[0].token_ids for o in overlapped.generate(prompts, params)] == reference


def test_batch_invariant_mode_gives_a_request_the_same_bits_alone_and_batched():
    needle = structured_params("json", 7, logprobs=2)
    others = [structured_params(n, s) for s, n in enumerate(["date", "choice", "grammar", "json"])]
    with LLM(seed=0, max_model_len=256, batch_invariant=True) as llm:
        alone = llm.generate("Flat is", needle)[0].outputs[0]
        batched = llm.generate(["Beautiful is", "Flat is", "Now is"] + ["Simple"] * 2,
                               [others[0], needle, *others[1:]])[1].outputs[0]
    assert alone.token_ids == batched.token_ids
    assert [{k: v.logprob for k, v in e.items()} for e in alone.logprobs] == \
           [{k: v.logprob for k, v in e.items()} for e in batched.logprobs]


@pytest.mark.slow
def test_pause_keep_sleep_and_resume_change_no_token():
    """Constrained requests paused mid-way (mode "keep"), the engine put to sleep (their KV is
    dropped and recomputed on wake) and resumed: every request's tokens equal an uninterrupted
    run's, and still obey their constraint."""
    prompts = ["Beautiful is", "Explicit is", "Simple is", "Flat is"]
    names = ["json", "date", "choice", "grammar"]
    params = [structured_params(n, s) for s, n in enumerate(names)]
    with LLM(seed=0, max_model_len=256, enable_sleep_mode=True) as llm:
        reference = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        engine, done = llm.llm_engine, {}
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), p, sp)
        for _ in range(3):
            done.update({o.request_id: o for o in engine.step() if o.finished})
        llm.sleep(level=1, mode="keep")  # pauses (keep): the requests give their KV back
        llm.wake_up()
        engine.resume_generation()
        for _ in range(2):
            done.update({o.request_id: o for o in engine.step() if o.finished})
        engine.pause_generation(mode="keep")  # and a plain pause, the KV kept
        engine.resume_generation()
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
    assert [list(done[str(i)].outputs[0].token_ids) for i in range(len(prompts))] == reference
    from structured import CONSTRAINTS
    assert all(CONSTRAINTS[n][1](done[str(i)].outputs[0].text) for i, n in enumerate(names))
