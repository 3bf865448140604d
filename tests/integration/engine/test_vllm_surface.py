"""vLLM 0.34's LLM / LLMEngine surface (issue 49): the defaults, signatures and names code written
for vLLM calls, each checked against what vLLM's source does (entrypoints/llm.py,
v1/engine/llm_engine.py, v1/engine/core.py) on the bundled model."""

from __future__ import annotations

import pytest

from spmd_engine import LLM, SamplingParams
from spmd_engine.config import ConfigError
from spmd_engine.sampling_params import RequestOutputKind

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PROMPTS = ["Beautiful is", "Simple is", "Flat is"]


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llm():
    with LLM(max_model_len=128, seed=0, enable_sleep_mode=True) as llm:
        yield llm


@pytest.mark.timeout(300)
def test_names_vllm_clients_call(llm):
    assert llm.get_tokenizer() is llm.llm_engine.tokenizer and llm.get_tokenizer().encode("a")[-1] == ord("a")
    assert llm.get_world_size() == 1 and llm.get_world_size(include_dp=False) == 1
    assert llm.get_weight_version() == "default"
    model = llm.llm_engine.model_executor.driver_worker.get_model()
    assert model is llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    assert llm.apply_model(lambda m: type(m).__name__) == [type(model).__name__]


@pytest.mark.timeout(300)
def test_per_request_arguments_vllm_takes(llm):
    want = ids(llm.generate(PROMPTS, GREEDY))
    assert ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=None, priority=0)) == want
    assert ids(llm.generate(PROMPTS, GREEDY, lora_request=[None] * 3, priority=[0, 0, 0])) == want
    with pytest.raises(TypeError, match="lora_request must be a LoRARequest or None, got object"):
        llm.generate(PROMPTS, GREEDY, lora_request=object())
    with pytest.raises(ValueError, match="Got priority 1 but Priority scheduling is not enabled"):
        llm.generate(PROMPTS, GREEDY, priority=[0, 1, 0])
    with pytest.raises(TypeError):
        llm.generate(PROMPTS, GREEDY, False)  # use_tqdm is keyword-only, as in vLLM


@pytest.mark.timeout(300)
def test_max_tokens_none_runs_to_the_context_and_max_logprobs_bounds_requests(llm):
    (out,) = llm.generate(["Now is"], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 128 - len(out.prompt_token_ids)
    assert out.outputs[0].finish_reason == "length"
    with pytest.raises(ConfigError, match="requested logprobs of 21, which is greater than max allowed: 20"):
        llm.generate(PROMPTS, SamplingParams(temperature=0.0, logprobs=21))
    with pytest.raises(ConfigError, match="requested prompt logprobs of 258, which is greater than max allowed"):
        llm.generate(PROMPTS, SamplingParams(temperature=0.0, prompt_logprobs=-1))


@pytest.mark.timeout(300)
def test_tokenization_kwargs_cut_the_prompt(llm):
    text = "Errors should never pass silently."
    tok = llm.get_tokenizer()
    full = tok.encode(text)
    for kwargs, kept in [({"truncation": True, "max_length": 10}, full[:10]),
                         ({"truncate_prompt_tokens": 6, "truncation_side": "left"}, full[-6:]),
                         ({"add_special_tokens": False}, full[1:])]:
        (out,) = llm.generate([text], GREEDY, tokenization_kwargs=kwargs)
        assert out.prompt_token_ids == kept, kwargs
        assert ids([out]) == ids(llm.generate([kept], GREEDY))
    with pytest.raises(ConfigError, match=r"tokenization_kwargs \['padding'\] are not supported"):
        llm.generate([text], GREEDY, tokenization_kwargs={"padding": "max_length"})


@pytest.mark.timeout(300)
def test_llm_engine_add_request_returns_the_id_and_takes_vllms_arguments(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=8, output_kind=RequestOutputKind.FINAL_ONLY)
    assert engine.add_request("r1", "Beautiful is", params, None, None, None, None, 0) == "r1"
    finals = []
    while engine.has_unfinished_requests():
        finals += engine.step()
    assert ids(finals) == ids(llm.generate(["Beautiful is"], GREEDY))
    with pytest.raises(ValueError, match="Priority scheduling is not enabled"):
        engine.add_request("r2", "x", params, priority=2)


@pytest.mark.timeout(300)
def test_collective_rpc_takes_vllms_positional_order(llm):
    """collective_rpc(method, timeout, args, kwargs): a positional call lands where vLLM puts it."""
    assert llm.collective_rpc(lambda w, a, b=0: a + b, None, (2,), {"b": 3}) == [5]
    assert llm.llm_engine.collective_rpc(lambda w, a: a, 5.0, ("x",)) == ["x"]
    with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
        llm.collective_rpc("get_model", 0)


@pytest.mark.timeout(300)
def test_sleep_levels_modes_and_the_scheduling_tag(llm):
    want = ids(llm.generate(PROMPTS, GREEDY))
    engine = llm.llm_engine
    # Level 0: scheduling pauses, requests are still accepted, nothing runs until woken.
    assert llm.sleep(level=0) == [] and llm.is_sleeping and engine.is_sleeping()
    engine.add_request("kept", "Beautiful is", SamplingParams(temperature=0.0, max_tokens=8))
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(PROMPTS, GREEDY)
    assert llm.wake_up(tags=["scheduling"]) is True and not llm.is_sleeping
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].outputs[0].token_ids == want[0]
    # Level 1, mode "abort" (vLLM's default): a running request is aborted, not a refusal.
    engine.add_request("running", "Simple is", SamplingParams(temperature=0.0, max_tokens=50))
    engine.step()
    llm.sleep(level=1)
    assert llm.wake_up(tags=["weights"]) is False and llm.is_sleeping  # kv_cache still away
    assert llm.wake_up(tags=["kv_cache"]) is True and not llm.is_sleeping  # scheduling resumes with it
    (aborted,) = engine.step()
    assert aborted.outputs[0].finish_reason == "abort"
    # Level 1, mode "keep": the request stays, recomputes its KV after the wake, and finishes as
    # if nothing had happened.
    engine.add_request("held", "Flat is", SamplingParams(temperature=0.0, max_tokens=8))
    engine.step()
    llm.sleep(level=1, mode="keep")
    llm.wake_up()
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].outputs[0].token_ids == want[2]
    with pytest.raises(ValueError, match="sleep level must be 0, 1 or 2"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="sleep mode must be one of"):
        llm.sleep(mode="later")
    assert ids(llm.generate(PROMPTS, GREEDY)) == want


@pytest.mark.timeout(120)
def test_stream_interval_sends_a_running_request_every_n_tokens(llm):
    """vLLM's rule: the first token, then every `stream_interval` tokens, and the finish; the
    deltas still add up to the whole output."""
    engine = llm.llm_engine
    for interval, sends in [(None, 10), (3, 4), (5, 3)]:  # tokens 1, 4, 7, 10 and 1, 6, 10
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stream_interval=interval,
                                output_kind=RequestOutputKind.DELTA)
        engine.add_request(f"s{interval}", "Beautiful is", params)
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        assert len(outs) == sends, interval
        assert [t for o in outs for t in o.outputs[0].token_ids] == ids(
            llm.generate(["Beautiful is"], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)))[0]
