"""vLLM 0.34's surface, on engines of their own (issue 49): EngineArgs and LLMEngine.from_engine_args
(torchtitan's path), vLLM's arguments refused when they would change a result, a timed-out
collective_rpc, and the checkpoint's generation_config.json as the default sampling parameters."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from spmd_engine import LLM, SamplingParams
from spmd_engine.config import ConfigError, ModelConfig
from spmd_engine.engine.arg_utils import EngineArgs
from spmd_engine.engine.llm_engine import LLMEngine
from spmd_engine.sampling_params import RequestOutputKind

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PROMPTS = ["Beautiful is", "Simple is", "Flat is"]


@pytest.mark.timeout(300)
def test_a_timed_out_collective_rpc_refuses_every_later_call():
    """The call may still run in the workers: the engine cannot prove its state clean."""
    with LLM(max_model_len=64) as llm:
        with pytest.raises(TimeoutError, match="timed out after 0.2 s"):
            llm.collective_rpc(lambda w: time.sleep(1.5), timeout=0.2)
        for call in (lambda: llm.generate(PROMPTS, GREEDY), lambda: llm.collective_rpc("get_model")):
            with pytest.raises(RuntimeError, match="refuses every call: collective_rpc.*timed out"):
                call()
        time.sleep(1.5)


@pytest.mark.timeout(300)
def test_engine_args_take_vllms_names_and_refuse_what_would_change_a_result():
    args = EngineArgs(model=ModelConfig().model_dir, max_model_len=64, disable_log_stats=True,
                      model_impl="auto", enforce_eager=True, seed=1)
    engine = LLMEngine.from_engine_args(args)
    try:
        engine.add_request("a", {"prompt_token_ids": [256, *b"Flat is"]},
                           SamplingParams(temperature=0.0, max_tokens=6, output_kind=RequestOutputKind.FINAL_ONLY))
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        assert outs[0].outputs[0].token_ids
    finally:
        engine.front_end.shutdown()
    with pytest.raises(TypeError, match="EngineArgs.__init__\\(\\) got an unexpected keyword argument 'no_such'"):
        EngineArgs(model=ModelConfig().model_dir, no_such=1)
    for name, value in [("kv_cache_dtype", "fp8"), ("hf_overrides", {"num_hidden_layers": 2}),
                        ("enable_lora_bias", True), ("tokenizer", "/elsewhere")]:
        with pytest.raises(ConfigError, match=f"{name}=.* is not supported by spmd_engine"):
            LLM(max_model_len=64, **{name: value})
@pytest.mark.timeout(300)
def test_generate_without_params_uses_the_checkpoints_defaults(tmp_path):
    """top_k=1 from the file makes unparameterised sampling greedy; 'vllm' turns the file off."""
    from spmd_engine import LLM, SamplingParams
    model = tmp_path / "model"
    shutil.copytree(ModelConfig().model_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"top_k": 1, "max_new_tokens": 12}))
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = ["Beautiful is", "Simple is", "Flat is"]
    with LLM(model=str(model), max_model_len=64, seed=3) as llm:
        assert llm.get_default_sampling_params().top_k == 1
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        assert [o.outputs[0].token_ids for o in llm.generate(prompts)] == want
    with LLM(model=str(model), max_model_len=64, seed=3, generation_config="vllm") as llm:
        plain = llm.get_default_sampling_params()
        assert plain == SamplingParams()
        sampled = [o.outputs[0].token_ids for o in llm.generate(prompts * 2)]
        assert sampled != want * 2  # temperature 1.0, no top_k: sampled, 16 tokens


@pytest.mark.timeout(300)
def test_return_sampling_mask_on_the_engine_gives_every_request_its_masks():
    """vLLM 0.34's LLM(return_sampling_mask=True) is engine-wide: each output carries, per token,
    the ids it could have been drawn from; here the same masks a request asking for them gets."""
    params = SamplingParams(temperature=1.0, top_k=5, max_tokens=6, seed=3)
    with LLM(max_model_len=64, return_sampling_mask=True) as llm:
        (out,) = llm.generate(["Flat is"], params)
    with LLM(max_model_len=64) as llm:
        (plain,) = llm.generate(["Flat is"], params)
        (asked,) = llm.generate(["Flat is"], SamplingParams(temperature=1.0, top_k=5, max_tokens=6, seed=3,
                                                            return_sampling_mask=True))
    assert plain.outputs[0].sampling_mask is None
    mask = out.outputs[0].sampling_mask
    assert len(mask) == 6 and all(len(mask[t]) == 5 for t in range(6))
    assert (mask.token_ids, mask.offsets) == (asked.outputs[0].sampling_mask.token_ids,
                                              asked.outputs[0].sampling_mask.offsets)
    assert out.outputs[0].token_ids == asked.outputs[0].token_ids
