"""Phi-3 (`Phi3ForCausalLM`): a Llama-family model with its own checkpoint layout and RoPE.

The network is Llama's (pre-norm, SwiGLU, no biases). What differs is read from config.json
here and handled by shared layers: the checkpoint stores `qkv_proj` and `gate_up_proj` fused
(ModelSpec.fused_checkpoint: each TP rank cuts its q, k, v / gate, up rows out of the one
tensor, linear.FUSED), `longrope` scaling (layers/longrope.py), and `partial_rotary_factor`
(only a head's first features turn). A `sliding_window` is read as for any model
(CausalLM.check_max_model_len).
"""

from __future__ import annotations

from typing import Any, Mapping

from spmd_engine.model.models.llama import CausalLM
from spmd_engine.model.spec import partial_rotary_factor


def read_config(cfg: Mapping[str, Any], source: str) -> tuple[Mapping[str, Any], dict]:
    """ModelSpec's family hook: Phi-3 has no biases whatever `attention_bias` says, and may
    turn part of each head."""
    return cfg, dict(qkv_bias=False, o_bias=False, mlp_bias=False, fused_checkpoint=True,
                     partial_rotary_factor=partial_rotary_factor(cfg, source))


class Phi3ForCausalLM(CausalLM):
    hf_config_architecture = "Phi3ForCausalLM"
