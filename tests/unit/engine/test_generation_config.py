"""generation_config="auto": the checkpoint's sampling values become the defaults, as vLLM reads them
(the differences from Hugging Face's GenerationConfig defaults, transformers' to_diff_dict as the
reference), and generate/chat without SamplingParams use them."""

import json

import pytest
from conftest import require_reference

from spmd_engine.config import ConfigError
from spmd_engine.engine.generation_config import SAMPLING_FIELDS, default_sampling_kwargs

CASES = [
    {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 40, "do_sample": True, "eos_token_id": 2},
    {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.1},  # HF 4's defaults count too
    {"bos_token_id": 1, "eos_token_id": [2, 3]},  # special tokens only: no sampling default
    {"min_p": 0.05, "temperature": 0.0},
]


def vllm_reading(diff: dict) -> dict:
    """vLLM's get_diff_sampling_param over a to_diff_dict (the reference, written from its source)."""
    out = {k: diff[k] for k in SAMPLING_FIELDS if diff.get(k) is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    return out


@pytest.mark.parametrize("config", CASES)
def test_the_same_defaults_as_vllm_reads_through_transformers(tmp_path, config):
    transformers = require_reference("transformers")
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    reference = transformers.GenerationConfig.from_pretrained(str(tmp_path)).to_diff_dict()
    assert default_sampling_kwargs(str(tmp_path)) == vllm_reading(reference)


def test_vllm_source_and_overrides(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 5}))
    assert default_sampling_kwargs(str(tmp_path), "vllm") == {}
    assert default_sampling_kwargs(str(tmp_path), "auto", {"top_k": 7, "seed": 3}) == {"temperature": 0.6, "top_k": 7}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0.5}))
    assert default_sampling_kwargs(str(tmp_path), str(other)) == {"top_p": 0.5}
    with pytest.raises(ConfigError, match="no such directory"):
        default_sampling_kwargs(str(tmp_path), str(tmp_path / "missing"))
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="generation_config.json: cannot read"):
        default_sampling_kwargs(str(tmp_path))
