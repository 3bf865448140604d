"""Sampling: greedy, temperature/top-k/top-p, seeds independent of batching, logprobs."""

import pytest
import torch

from spmd_engine.config import ConfigError
from spmd_engine.sampler import Sampler
from spmd_engine.sampling_params import SamplingParams


def test_greedy_is_argmax_and_logprobs_hold_top_k_plus_sampled():
    s = Sampler()
    s.add_request("a", SamplingParams(logprobs=2), seed=0)
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    tokens, logprobs = s.sample(["a"], logits)
    assert tokens == [1]
    expected = torch.log_softmax(logits[0], -1)
    assert set(logprobs[0]) == {1, 3}
    assert logprobs[0][3] == (pytest.approx(float(expected[3])), 2)  # (logprob, rank)
    assert logprobs[0][1] == (pytest.approx(float(expected[1])), 1)
    # logprobs=0: the sampled token alone, with its rank in the distribution.
    s.add_request("b", SamplingParams(logprobs=0, temperature=1.0), seed=1)
    tokens, logprobs = s.sample(["b"], logits)
    (token,) = tokens
    assert list(logprobs[0]) == [token]
    assert logprobs[0][token][1] == int((expected > expected[token]).sum()) + 1


def test_seeded_stream_does_not_depend_on_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)

    seeds = {"a": 11, "b": 22, "c": 33}  # fixed: hash(str) changes with every interpreter

    def draws(batch_ids, rows, seeds=seeds):
        s = Sampler()
        for rid in batch_ids:
            s.add_request(rid, params, seed=seeds[rid])
        return [s.sample(batch_ids, logits[rows])[0] for _ in range(8)]

    alone = draws(["b"], [1])
    batched = draws(["a", "b", "c"], [0, 1, 2])
    assert [t[0] for t in alone] == [t[1] for t in batched]
    # Negative control: the stream is the seed's (another seed for "b" draws other tokens).
    assert [t[0] for t in draws(["b"], [1], {"b": 23})] != [t[0] for t in alone]


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = torch.tensor([[0.1, 0.5, 4.0, 0.2]])
    for params in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6)):
        s = Sampler()
        s.add_request("x", params, seed=3)
        assert all(s.sample(["x"], logits)[0] == [2] for _ in range(10))


@pytest.mark.parametrize("kwargs", [{"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_p": 1.5},
                                    {"top_k": -2}, {"logprobs": -1}])
def test_invalid_sampling_params(kwargs):
    with pytest.raises(ConfigError):
        SamplingParams(**kwargs)
