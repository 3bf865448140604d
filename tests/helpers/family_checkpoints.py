"""Random-weight Phi-3 and OLMo 2 checkpoints written by transformers itself.

The config class and the model class are transformers' (`save_pretrained`), so the tensor
names, the fused Phi-3 layout and config.json are exactly what a hub checkpoint holds. Tiny,
but with every feature the engine must honour on: GQA, Phi-3's longrope with distinct short
and long factors and max_position_embeddings above the original context (prompts past
`ORIGINAL_CONTEXT` tokens use the long factors) plus a partial rotary; OLMo 2's
whole-projection q/k norms with weights far from 1 (so a per-rank norm shows) and attention
biases.
"""

from __future__ import annotations

from pathlib import Path

import torch

ORIGINAL_CONTEXT = 24  # Phi-3's original_max_position_embeddings in these checkpoints
COMMON = dict(vocab_size=131, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)


def phi3_config(partial_rotary_factor: float = 0.5, **changes):
    from transformers import Phi3Config
    head_dim = COMMON["hidden_size"] // COMMON["num_attention_heads"]
    half = int(head_dim * partial_rotary_factor) // 2
    gen = torch.Generator().manual_seed(3)
    short = (1.0 + torch.rand(half, generator=gen)).tolist()
    long = (1.0 + 8 * torch.rand(half, generator=gen)).tolist()
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short, "long_factor": long,
            "partial_rotary_factor": partial_rotary_factor}
    return Phi3Config(**{**COMMON, "original_max_position_embeddings": ORIGINAL_CONTEXT, "rope_parameters": rope,
                         "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **changes})


def olmo2_config(**changes):
    from transformers import Olmo2Config
    return Olmo2Config(**{**COMMON, "attention_bias": True, "pad_token_id": 0, "bos_token_id": 1,
                          "eos_token_id": 2, **changes})


def save_random(config, path: Path, seed: int = 0) -> Path:
    """The model class of `config` with random weights (norm weights spread around 1) saved to
    `path` in float32."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand_like(p))  # far from ones: each feature's weight matters
            else:
                p.copy_(torch.randn_like(p) / (p.shape[-1] ** 0.5 if p.dim() > 1 else 4.0))
    model.save_pretrained(str(path))
    return path
