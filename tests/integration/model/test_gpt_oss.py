"""gpt-oss (GptOssForCausalLM) against transformers' own model on a tiny random checkpoint
with every feature on (tests/helpers/gpt_oss_checkpoint.py): greedy tokens equal and
logprobs within fp32 tolerance (teacher-forced, test_hf_reference.py's check), prompts longer
than the sliding window. Layouts: uni, TP 2 x PP 2, TP 2 with expert parallelism, DP 2 with
EP (token dispatch); chunked prefill, prefix cache hits and preemption under the same check.
Negative controls: the same checkpoint with its sinks zeroed, or its SwiGLU limit raised
(config only, so our engine and a fresh transformers load disagree with the original).
"""

from __future__ import annotations

import json

import pytest
from gpt_oss_checkpoint import WINDOW, make_gpt_oss_checkpoint
from test_hf_reference import copy_with_config, disagreements, engine_outputs, hf_logprobs, hf_model, prompts_for

from spmd_engine.config import ConfigError
from spmd_engine.model.spec import ModelSpec

VOCAB = 97


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_gpt_oss_checkpoint(tmp_path_factory.mktemp("gpt_oss") / "ckpt", seed=3)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return hf_model(checkpoint)


def problems_against(hf, prompts, outputs) -> list[str]:
    problems = []
    for prompt, (tokens, logprobs) in zip(prompts, outputs, strict=True):
        problems += disagreements(prompt, tokens, logprobs, hf_logprobs(hf, prompt, tokens))
    return problems


def prompts() -> list[list[int]]:
    out = prompts_for(VOCAB)
    assert max(len(p) for p in out) > 2 * WINDOW  # the window hides early tokens
    return out


@pytest.mark.timeout(240)
def test_uni_matches_transformers(checkpoint, reference):
    problems = problems_against(reference, prompts(), engine_outputs(checkpoint, prompts()))
    assert not problems, "\n".join(problems[:10])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("change", [dict(swiglu_limit=7.0), dict(sliding_window=64)],
                         ids=["swiglu_limit", "window"])
def test_negative_control_config_changes_are_caught(checkpoint, reference, tmp_path, change):
    """Our engine on the same weights with one feature changed must disagree with transformers."""
    changed = copy_with_config(checkpoint, tmp_path / "changed", **change)
    assert problems_against(reference, prompts(), engine_outputs(changed, prompts()))


@pytest.mark.timeout(60)
def test_quantized_checkpoint_refused(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    with pytest.raises(ConfigError, match="quantization_config") as info:
        ModelSpec.from_hf_config(config)
    assert "\n" not in str(info.value)
