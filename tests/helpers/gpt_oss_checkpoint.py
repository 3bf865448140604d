"""A tiny random gpt-oss checkpoint written by transformers itself (GptOssConfig +
GptOssForCausalLM.save_pretrained), every feature on: non-zero attention sinks and biases
(q/k/v/o, router, experts), YaRN RoPE with a factor, sliding and full layers alternating with
a window shorter than the test prompts, 4 experts top-2, a clamp limit the activations reach.
"""

from __future__ import annotations

from pathlib import Path

import torch

WINDOW = 6
CONFIG = dict(vocab_size=97, hidden_size=32, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
              sliding_window=WINDOW, max_position_embeddings=64, swiglu_limit=1.0, swiglu_alpha=1.702,
              rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0,
                               "truncate": False, "original_max_position_embeddings": 16,
                               "rope_theta": 10000.0},
              layer_types=["sliding_attention", "full_attention"] * 2, tie_word_embeddings=False)


def make_gpt_oss_checkpoint(out_dir: Path, seed: int = 0, **changes) -> Path:
    from transformers import GptOssConfig, GptOssForCausalLM
    torch.manual_seed(seed)
    config = GptOssConfig(**{**CONFIG, **changes})
    config.architectures = ["GptOssForCausalLM"]
    model = GptOssForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * noise)
            elif name.endswith("sinks"):
                param.copy_(noise)
            else:
                param.copy_(0.15 * noise)
    model.save_pretrained(str(out_dir))
    return Path(out_dir)
