"""SamplingParams' defaults and meanings are vLLM 0.34's (its sampling_params.py is the reference):
code written for vLLM that leaves a field out gets what it would get there."""

import dataclasses
import logging

import pytest

from spmd_engine.config import ConfigError
from spmd_engine.sampling_params import SamplingParams, SamplingType


def test_unset_fields_mean_what_they_mean_in_vllm():
    p = SamplingParams()
    assert p.temperature == 1.0 and not p.greedy  # vLLM samples at temperature 1.0 unless asked
    assert p.sampling_type == SamplingType.RANDOM
    assert (p.n, p.top_p, p.top_k, p.min_p, p.max_tokens, p.min_tokens) == (1, 1.0, 0, 0.0, 16, 0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.seed is None and p.logprobs is None and p.prompt_logprobs is None and p.stop == []


def test_fields_come_in_vllms_order():
    """A positional call lands where it would in vLLM (n, presence_penalty, frequency_penalty, ...)."""
    names = [f.name for f in dataclasses.fields(SamplingParams)]
    assert names[:12] == ["n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature",
                          "watermarking", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids"]
    assert SamplingParams(3).n == 3


def test_minus_one_seed_is_no_seed_and_true_logprobs_is_one():
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=-1, temperature=0.5).sampling_type == SamplingType.RANDOM
    assert SamplingParams(seed=7, temperature=0.5).sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams(logprobs=True).logprobs == 1 and SamplingParams(prompt_logprobs=True).prompt_logprobs == 1
    assert SamplingParams(logprobs=-1).logprobs == -1  # the whole vocabulary
    with pytest.raises(ConfigError, match="logprobs must be an integer >= 0, or -1"):
        SamplingParams(logprobs=-2)


def test_tiny_temperatures_are_raised_as_vllm_raises_them(caplog):
    with caplog.at_level(logging.WARNING, logger="spmd_engine"):
        assert SamplingParams(temperature=0.001).temperature == 0.01
    assert "raised to 0.01" in caplog.text
    assert SamplingParams(temperature=1e-6).temperature == 0.01  # vLLM raises it too: only 0 is greedy
    with pytest.raises(ConfigError, match=r"temperature must be a number in \[0, 2\]"):
        SamplingParams(temperature=2.5)


def test_greedy_drops_the_filters_as_vllm_does():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0) and p.sampling_type == SamplingType.GREEDY


def test_max_tokens_none_is_allowed_and_min_tokens_checked_only_against_a_number():
    assert SamplingParams(max_tokens=None, min_tokens=50).max_tokens is None
    with pytest.raises(ConfigError, match=r"min_tokens \(5\) must be <= max_tokens \(4\)"):
        SamplingParams(max_tokens=4, min_tokens=5)


@pytest.mark.parametrize("field, value", [("watermarking", True), ("thinking_token_budget", 10)])
def test_vllm_fields_that_would_change_a_result_are_refused_by_name(field, value):
    with pytest.raises(ConfigError, match=f"SamplingParams.{field}=.* is not supported"):
        SamplingParams(**{field: value})


def test_spaces_between_special_tokens_is_accepted_as_vllm_accepts_it_for_fast_tokenizers():
    """lm-eval passes False on every generate_until; vLLM's detokenizer reads it only for slow
    (Python) tokenizers, and every tokenizer here is a fast one."""
    assert SamplingParams(spaces_between_special_tokens=False).spaces_between_special_tokens is False


def test_from_optional_and_clone():
    p = SamplingParams.from_optional(temperature=None, top_p=0.9, max_tokens=None)
    assert p.temperature == 1.0 and p.top_p == 0.9 and p.max_tokens == 16  # None: the default
    c = SamplingParams(stop=["x"]).clone()
    c.stop.append("y")
    assert c.stop == ["x", "y"]
    assert SamplingParams(stop=["x"]).stop == ["x"]
