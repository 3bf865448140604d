"""YaRN RoPE (gpt-oss, DeepSeek-V2/V3) against transformers' own rope init function.

Each case is a config transformers builds and reads itself: the inverse frequencies and the
factor on cos/sin must be its, for truncated and untruncated ramps, explicit and derived
attention factors (mscale over mscale_all_dim) and a factor left for the context ratio.
"""

from __future__ import annotations

import pytest
import torch
from conftest import require_reference

from spmd_engine.model.layers.rotary import RotaryEmbedding, inv_frequencies, yarn_attention_factor

GPT_OSS = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
           "original_max_position_embeddings": 4096}
DEEPSEEK = {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}
CASES = {
    "gpt-oss": (64, 150000.0, GPT_OSS, 131072),
    "deepseek-v3": (64, 10000.0, DEEPSEEK, 163840),
    "mscale-ratio": (32, 10000.0, {**DEEPSEEK, "mscale": 0.707, "mscale_all_dim": 1.0}, 163840),
    "attention-factor": (16, 10000.0, {**GPT_OSS, "truncate": True, "attention_factor": 0.8,
                                       "beta_fast": 8, "beta_slow": 2}, 65536),
    "no-factor": (16, 500000.0, {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 2048},
                  8192),
}


def _transformers_yarn(head_dim, theta, scaling, max_positions):
    rope_utils = require_reference("transformers.modeling_rope_utils")
    from transformers import LlamaConfig

    heads = 4
    config = LlamaConfig(hidden_size=head_dim * heads, num_attention_heads=heads, head_dim=head_dim,
                         max_position_embeddings=max_positions,
                         rope_parameters={**scaling, "rope_theta": theta})
    inv_freq, attention_factor = rope_utils.ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    return inv_freq.float(), attention_factor


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", CASES)
def test_yarn_matches_transformers(case):
    head_dim, theta, scaling, max_positions = CASES[case]
    hf_inv, hf_factor = _transformers_yarn(head_dim, theta, scaling, max_positions)
    ours = inv_frequencies(head_dim, theta, scaling, max_positions)
    assert torch.allclose(ours, hf_inv, rtol=1e-6, atol=0), (ours - hf_inv).abs().max()
    assert yarn_attention_factor(scaling, max_positions) == pytest.approx(hf_factor, rel=1e-12)
    rope = RotaryEmbedding(head_dim, theta, scaling, max_positions)
    positions = torch.tensor([0, 1, 7, 4095, 70000])
    cos, sin = rope.cos_sin(positions, torch.float32)
    angles = positions.float()[:, None] * hf_inv
    assert torch.allclose(cos[:, 0, : head_dim // 2], angles.cos() * hf_factor, atol=1e-5)
    assert torch.allclose(sin[:, 0, head_dim // 2:], angles.sin() * hf_factor, atol=1e-5)


@pytest.mark.timeout(60)
def test_yarn_truncation_is_seen():
    """Negative control for the comparison: truncating gpt-oss's ramp (it turns truncation
    off) moves its frequencies away from transformers'."""
    head_dim, theta, scaling, max_positions = CASES["gpt-oss"]
    hf_inv, _ = _transformers_yarn(head_dim, theta, scaling, max_positions)
    wrong = inv_frequencies(head_dim, theta, {**scaling, "truncate": True}, max_positions)
    assert not torch.allclose(wrong, hf_inv, rtol=1e-6, atol=0)
