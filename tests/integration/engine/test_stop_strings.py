"""Stop strings and the output text options of SamplingParams, as vLLM means them (issue 13).

The bundled model recites the Zen of Python with a byte tokenizer, so every
stop string of two or more characters spans several tokens, and what it
writes is known in advance (tests/helpers/zen.py).
"""

from __future__ import annotations

import json

import pytest
from engine_helpers import make_tiny_checkpoint
from zen import continuation

from spmd_engine import LLM, SamplingParams
from spmd_engine.config import ConfigError

PROMPT = "Beautiful is"  # the model goes on: " better than ugly.\nExplicit is better than implicit.\n..."


@pytest.fixture
def llm():  # one uni engine per process at a time: test_skip_special_tokens builds its own
    with LLM(max_model_len=256) as llm:
        yield llm


def one(llm, prompt=PROMPT, **params):
    return llm.generate(prompt, SamplingParams(**{"temperature": 0.0, "max_tokens": 60, **params}))[0].outputs[0]


@pytest.mark.timeout(120)
def test_stop_string_split_across_tokens_ends_the_request(llm):
    expected = continuation(PROMPT)
    full = one(llm)
    assert full.text == expected[:60] and full.finish_reason == "length"
    out = one(llm, stop=["than"])  # four byte tokens: found only in the decoded text
    assert (out.text, out.finish_reason, out.stop_reason) == (" better ", "stop", "than")
    # The tokens that made the string stay in token_ids (vLLM's behaviour), the text does not.
    assert bytes(out.token_ids) == b" better than"
    # Of several stop strings, the first to appear wins; one spanning a line break works too.
    out = one(llm, stop=["implicit", "ugly.\nEx"])
    assert (out.text, out.stop_reason) == (" better than ", "ugly.\nEx")
    assert bytes(out.token_ids).decode() == " better than ugly.\nEx"
    # Completed by the last token max_tokens allows: "stop" wins over "length", as in vLLM.
    out = one(llm, stop="than", max_tokens=len(" better than"))
    assert (out.text, out.finish_reason, out.stop_reason) == (" better ", "stop", "than")
    # A string the model never writes changes nothing.
    assert one(llm, stop=["Zebra"]).text == full.text


@pytest.mark.timeout(120)
def test_include_stop_str_in_output(llm):
    out = one(llm, stop="than", include_stop_str_in_output=True)
    assert (out.text, out.finish_reason, out.stop_reason) == (" better than", "stop", "than")


@pytest.mark.timeout(120)
def test_stop_strings_per_prompt_and_with_n(llm):
    prompts = [PROMPT, "Errors should", "Simple is"]
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=40, stop="than"), SamplingParams(temperature=0.0, max_tokens=40),
                                  SamplingParams(temperature=0.0, max_tokens=40, stop=["."], n=2)])
    assert outs[0].outputs[0].text == " better "
    assert outs[1].outputs[0].text == continuation("Errors should")[:40]
    assert [c.text for c in outs[2].outputs] == [" better than complex"] * 2


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", [dict(data_parallel_size=2), dict(pipeline_parallel_size=2)],
                         ids=["dp2", "mp-pp2"])
@pytest.mark.slow
def test_stop_strings_in_other_engine_layouts(layout):
    """DP = 2: each replica's EngineCore runs in its own process and finds the strings there;
    mp PP = 2: two steps in flight (the batch queue), each request in one of them."""
    prompts = [PROMPT, "Errors should", "Simple is", "Readability"]
    with LLM(max_model_len=256, **layout) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=60, stop=["than", "silently"]))
    got = [(o.outputs[0].text, o.outputs[0].stop_reason) for o in outs]
    assert got == [(" better ", "than"), (" never pass ", "silently"), (" better ", "than"),
                   (continuation("Readability")[:60], None)], got


@pytest.mark.timeout(120)
def test_detokenize_false_returns_token_ids_only(llm):
    with_text = one(llm, max_tokens=20)
    out = one(llm, max_tokens=20, detokenize=False, logprobs=0)
    assert out.text == "" and out.token_ids == with_text.token_ids
    assert all(lp.decoded_token is None for step in out.logprobs for lp in step.values())
    assert with_text.text == continuation(PROMPT)[:20]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("params, message", [
    (dict(stop=[""]), "stop must not contain an empty string"),
    (dict(stop=["ok", ""]), "stop must not contain an empty string"),
    (dict(stop=5), "stop must be a string or a list of strings"),
    (dict(stop="x", detokenize=False), "stop strings need detokenize=True"),
    (dict(skip_special_tokens="no"), "skip_special_tokens must be True or False"),
])
def test_bad_stop_arguments_are_named(llm, params, message):
    with pytest.raises(ConfigError, match=message):
        SamplingParams(**params)
    assert one(llm, max_tokens=4).text == continuation(PROMPT)[:4]  # the engine still works


def _word_level_tokenizer(path, vocab_size: int, special: dict[int, str]) -> None:
    """A tokenizer.json naming token i "t<i>", with `special` ids as special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {special.get(i, f"t{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(special.values()))
    tok.save(str(path / "tokenizer.json"))


@pytest.mark.timeout(120)
def test_skip_special_tokens(tmp_path):
    """A special token in the output is in the text only with skip_special_tokens=False."""
    ckpt = make_tiny_checkpoint(tmp_path / "tiny", seed=3)
    prompt, params = [5, 6, 7], dict(max_tokens=8, ignore_eos=True, temperature=0.0)
    with LLM(model=str(ckpt), max_model_len=64) as llm:
        ids = llm.generate([prompt], SamplingParams(**params))[0].outputs[0].token_ids
    marked = ids[3]  # a token the model writes, made special in the tokenizer below
    _word_level_tokenizer(ckpt, 300, {marked: "<sp>", 2: "</s>"})
    with LLM(model=str(ckpt), max_model_len=64) as llm:
        kept = llm.generate([prompt], SamplingParams(skip_special_tokens=False, **params))[0].outputs[0]
        dropped = llm.generate([prompt], SamplingParams(**params))[0].outputs[0]
        # A stop string is looked for in the same text the output shows.
        stop = llm.generate([prompt], SamplingParams(stop="<sp>", skip_special_tokens=False, **params))[0].outputs[0]
    assert kept.token_ids == dropped.token_ids == ids
    assert "<sp>" in kept.text.split() and "<sp>" not in dropped.text
    assert dropped.text.split() == [f"t{i}" for i in ids if i != marked]
    assert stop.stop_reason == "<sp>" and stop.token_ids == ids[:ids.index(marked) + 1]
    assert json.loads((ckpt / "config.json").read_text())["eos_token_id"] == 2
