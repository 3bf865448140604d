"""skip_tokenizer_init=True (vLLM's): RL trainers tokenize themselves and read token ids back, so
the engine loads no tokenizer: token-id prompts run as usual, outputs carry the ids with empty
text, and whatever needs a tokenizer (text prompts, stop strings) is refused naming the flag."""

from __future__ import annotations

import pytest

from spmd_engine import LLM, SamplingParams
from spmd_engine.config import ConfigError

PROMPTS = [[256, 66, 101, 97, 117], {"prompt_token_ids": [256, 69, 114, 114]}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)


def bundled(skip: bool) -> LLM:
    """The bundled model, whose byte tokenizer is there to skip."""
    return LLM(max_model_len=64, skip_tokenizer_init=skip)


@pytest.fixture(scope="module")
def with_tokenizer():
    with bundled(False) as llm:  # closed before the next engine: one uni engine per process at a time
        return llm.generate(PROMPTS, GREEDY)


@pytest.mark.timeout(120)
def test_token_ids_in_token_ids_out_and_no_text(with_tokenizer):
    with bundled(True) as llm:
        assert llm.llm_engine.inputs.tokenizer is None
        with pytest.raises(RuntimeError, match="skip_tokenizer_init=True"):
            llm.get_tokenizer()
        outs = llm.generate(PROMPTS, GREEDY)
    for out, want in zip(outs, with_tokenizer):
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        assert want.outputs[0].text and out.outputs[0].text == ""
        assert out.prompt is None and out.prompt_token_ids == want.prompt_token_ids
        step = out.outputs[0].logprobs[0]  # values kept, no decoded token
        assert [(t, lp.logprob, lp.decoded_token) for t, lp in step.items()] == \
            [(t, lp.logprob, None) for t, lp in want.outputs[0].logprobs[0].items()]


@pytest.mark.timeout(120)
def test_what_needs_a_tokenizer_is_refused_naming_the_flag(with_tokenizer):
    with bundled(True) as llm:
        for prompt in ("Beautiful is", {"prompt": "Beautiful is"}):
            with pytest.raises(ConfigError, match="skip_tokenizer_init=True"):
                llm.generate(prompt, GREEDY)
        with pytest.raises(ConfigError, match="stop strings need the detokenizer.*skip_tokenizer_init=True"):
            llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=4, stop=["e"]))
        with pytest.raises(ConfigError, match="bad_words.*skip_tokenizer_init=True"):
            llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=4, bad_words=["e"]))
        # Token-level stops need no text: generation ends on the id, as with a tokenizer.
        ids = with_tokenizer[0].outputs[0].token_ids
        stop = ids[2]
        out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop]))
        assert out[0].outputs[0].finish_reason == "stop"
        assert out[0].outputs[0].token_ids == ids[:ids.index(stop) + 1]

