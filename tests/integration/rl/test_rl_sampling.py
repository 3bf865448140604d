"""`n` samples per prompt and sampled-token logprobs in vLLM's shape (issue 13)."""

from __future__ import annotations

import math

import pytest
import torch
from engine_helpers import make_tiny_checkpoint

from spmd_engine import LLM, Logprob, SamplingParams
from spmd_engine.config import ConfigError

PROMPT = list(range(1, 41))  # two full 16-token blocks and a tail


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=5)


@pytest.fixture(scope="module")
def llm(ckpt):
    with LLM(model=str(ckpt), max_model_len=64, seed=11) as llm:
        yield llm


def sampled(llm, prompts, **params):
    return llm.generate(prompts, SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True, **params))


@pytest.mark.timeout(120)
def test_n_samples_indexed_distinct_and_seeded(llm):
    (out,) = sampled(llm, [PROMPT], n=4, seed=123)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert out.prompt_token_ids == PROMPT
    samples = [c.token_ids for c in out.outputs]
    assert all(len(s) == 12 for s in samples)
    assert len({tuple(s) for s in samples}) == 4  # each sample its own random stream
    # Reproducible with the seed; sample k is the request with seed + k.
    assert [c.token_ids for c in sampled(llm, [PROMPT], n=4, seed=123)[0].outputs] == samples
    for k in range(4):
        assert sampled(llm, [PROMPT], seed=123 + k)[0].outputs[0].token_ids == samples[k]
    # Without a request seed: fresh draws from the engine's stream, different on every call (vLLM).
    unseeded = [c.token_ids for c in sampled(llm, [PROMPT, [5, 6]], n=3)[0].outputs]
    again = [c.token_ids for c in sampled(llm, [PROMPT, [5, 6]], n=3)[0].outputs]
    assert len({tuple(s) for s in unseeded}) == 3 and unseeded != again


@pytest.mark.timeout(120)
def test_n_samples_prefill_the_shared_prompt_once(llm):
    llm.reset_prefix_cache()
    before = llm.get_stats()[0]["runner"]["prefill_tokens"]
    outs = sampled(llm, [PROMPT, [7, 8, 9]], n=4)
    computed = llm.get_stats()[0]["runner"]["prefill_tokens"] - before
    # The first sample computes the 40 + 3 prompt tokens; the other 3 + 3 samples of each
    # prompt only their tails past the shared full blocks (8 and 3 tokens).
    assert computed == 40 + 3 + 3 * 8 + 3 * 3, computed
    assert [len(o.outputs) for o in outs] == [4, 4]


@pytest.mark.timeout(120)
def test_sampled_token_logprobs_in_vllm_shape(llm, ckpt):
    (out,) = sampled(llm, [PROMPT], n=2, seed=9, logprobs=0)
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        for token, step in zip(c.token_ids, c.logprobs):
            assert list(step) == [token]  # logprobs=0: the sampled token only
            assert isinstance(step[token], Logprob) and step[token].logprob <= 0 and step[token].rank >= 1
        assert c.cumulative_logprob == pytest.approx(sum(s[t].logprob for s, t in zip(c.logprobs, c.token_ids)))
    # The logprob is log_softmax of the model's logits (before temperature), and the rank is its
    # place in that distribution: checked against a no-cache forward of the same sequence.
    from spmd_engine.model import load_model
    from spmd_engine.model.solo import SoloGroup
    model = load_model(ckpt, SoloGroup(), SoloGroup())
    c = out.outputs[1]
    ids = PROMPT + c.token_ids
    with torch.inference_mode():
        hidden = model.forward(torch.tensor([ids]), torch.arange(len(ids))[None, :], None)["hidden_states"]
        logp = torch.log_softmax(model.compute_logits(hidden[0, len(PROMPT) - 1:-1]), dim=-1)
    for t, (token, step) in enumerate(zip(c.token_ids, c.logprobs)):
        assert math.isclose(step[token].logprob, float(logp[t, token]), abs_tol=1e-4)
        assert step[token].rank == int((logp[t] > logp[t, token]).sum()) + 1
    # Greedy with top-2: ranks 1 and 2, the sampled token is rank 1.
    (greedy,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=3, logprobs=2))
    first = greedy.outputs[0]
    assert sorted(lp.rank for lp in first.logprobs[0].values()) == [1, 2]
    assert first.logprobs[0][first.token_ids[0]].rank == 1
    # Without logprobs: none, and no cumulative logprob.
    assert greedy.outputs[0].cumulative_logprob is not None
    (plain,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=3))
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_n_is_named(llm, bad):
    with pytest.raises(ConfigError, match=f"n must be an integer >= 1.*n={bad!r}"):
        SamplingParams(temperature=0.0, n=bad)
    assert len(sampled(llm, [PROMPT], n=2)[0].outputs) == 2


@pytest.mark.timeout(60)
def test_on_output_streams_each_prompt_once_with_all_samples(llm):
    seen = []
    outs = llm.generate([PROMPT, [3, 4]], SamplingParams(temperature=0.0, max_tokens=4, n=3),
                        on_output=lambda i, o: seen.append((i, len(o.outputs))))
    assert sorted(seen) == [(0, 3), (1, 3)]
    assert [o.request_id for o in outs] == [o.request_id for o in outs if "_" not in o.request_id]
