"""A tiny random Gemma 3 text checkpoint written by transformers itself (Gemma3TextConfig +
Gemma3ForCausalLM.save_pretrained), every feature of the family on: sliding and full layers
interleaved with a window shorter than the test prompts, each kind's rope with its own theta
and a linear scaling factor, head_dim != hidden / heads, query_pre_attn_scalar != head_dim,
final_logit_softcapping, tied embeddings, GQA. transformers initialises Gemma's norms to zero
(a scale of 1 + 0): they get random values here, so a norm missing its `1 +` shows.
"""

from __future__ import annotations

from pathlib import Path

import torch

WINDOW = 8
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
CONFIG = dict(
    vocab_size=131, hidden_size=64, intermediate_size=96, num_hidden_layers=len(LAYER_TYPES),
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
    sliding_window=WINDOW, layer_types=LAYER_TYPES, max_position_embeddings=256,
    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                     "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}},
    final_logit_softcapping=3.0, tie_word_embeddings=True,
)


def make_gemma3_checkpoint(path: Path, seed: int = 0, **changes) -> Path:
    """`CONFIG` with `changes`, random weights (norms included), saved as transformers saves it."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**{**CONFIG, **changes}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(str(path))
    return Path(path)
