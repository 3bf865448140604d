"""Tiny random DeepSeek-V3 / V2 checkpoints written by transformers itself (config class, model
class, save_pretrained), every feature on: q_lora_rank set (V3) or None (V2), dense layers
before the sparse ones, shared experts, two groups of experts with one kept, a non-zero
e_score_correction_bias (V3), norm_topk_prob and routed_scaling_factor."""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import require_reference

COMMON = dict(vocab_size=157, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
              kv_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=2, topk_group=1,
              first_k_dense_replace=2, max_position_embeddings=512, tie_word_embeddings=False)
# YaRN with a short original context, so every prompt is past it; mscale != mscale_all_dim puts
# a factor on cos/sin as well as on the softmax scale.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "mscale": 1.0, "mscale_all_dim": 0.7, "beta_fast": 32.0, "beta_slow": 1.0}
CONFIGS = {
    "v3": dict(COMMON, q_lora_rank=48, norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True,
               rope_parameters=YARN),
    "v3-plainrope": dict(COMMON, q_lora_rank=48, norm_topk_prob=False, routed_scaling_factor=1.5,
                         rope_interleave=False),
    "v2-greedy": dict(COMMON, q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1,
                      routed_scaling_factor=1.0),  # V2-Lite's router: one group
    "v2": dict(COMMON, q_lora_rank=None, topk_method="group_limited_greedy", routed_scaling_factor=1.5,
               rope_parameters=dict(YARN, mscale_all_dim=1.0, factor=2.0)),
}


def make_deepseek_checkpoint(out_dir: Path, name: str, seed: int = 0) -> Path:
    """Write CONFIGS[name] with random weights (std 0.1, RMSNorm weights near 1, correction
    biases of the scores' size) to `out_dir` in float32; returns it."""
    transformers = require_reference("transformers")
    cfg = dict(CONFIGS[name])
    config_cls, model_cls = ((transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM) if name.startswith("v2")
                             else (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM))
    config = config_cls(**cfg)
    gen = torch.Generator().manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for param_name, tensor in model.state_dict().items():
            if param_name.endswith("norm.weight"):
                tensor.copy_(1 + 0.1 * torch.randn(tensor.shape, generator=gen))
            elif param_name.endswith("e_score_correction_bias"):
                tensor.copy_(0.3 * torch.randn(tensor.shape, generator=gen))
            else:
                tensor.copy_(0.1 * torch.randn(tensor.shape, generator=gen))
    model.save_pretrained(str(out_dir))
    return Path(out_dir)
