"""gpt-oss (`GptOssForCausalLM`): what this family's checkpoints name differently.

The model itself is the Llama-family CausalLM (llama.py) with the options ModelSpec reads
from its config.json: q/k/v/o biases, attention sinks (sink_attention.py), sliding-window
and full layers alternating (`layer_types`, windows.py), YaRN RoPE (rotary.py), and a MoE
block in every layer whose router has a bias and softmaxes its top-k logits and whose
experts have biases and the clamped SwiGLU (moe_block.py, fused_moe.py). What is left here
are the tensor names: transformers keeps all experts of a layer in one tensor per
projection (`mlp.experts.gate_up_proj` [E, H, 2I], gate and up interleaved column by column;
`down_proj` [E, I, H]; their biases), the router under `mlp.router`, and the sinks as
`self_attn.sinks`. Each rank still reads only its experts' (EP) or widths' (TP) slices:
FusedMoE's loader takes these tensors whole-named and slices them.

Real gpt-oss checkpoints are MXFP4-quantised (their `quantization_config`); ModelSpec
refuses those, so only the unquantised (bf16/fp32) form loads.
"""

from __future__ import annotations

from typing import Iterator

from spmd_engine.model.spec import ModelSpec

ARCHITECTURE = "GptOssForCausalLM"
# Our FusedMoE / router parameters -> (HF tensor under `mlp.`, FusedMoE shard_id)
_MLP_NAMES = {
    "experts.w13_weight": ("experts.gate_up_proj", ("gate_up_proj", None)),
    "experts.w13_bias": ("experts.gate_up_proj_bias", ("gate_up_proj_bias", None)),
    "experts.w2_weight": ("experts.down_proj", ("down_proj", None)),
    "experts.w2_bias": ("experts.down_proj_bias", ("down_proj_bias", None)),
    "gate.weight": ("router.weight", None),
    "gate.bias": ("router.bias", None),
}


def hf_names(param_name: str) -> Iterator[tuple[str, object]]:
    """(HF tensor name, shard_id) feeding one of our parameters."""
    if param_name.endswith(".self_attn.attn.sinks.weight"):
        yield param_name.replace(".self_attn.attn.sinks.weight", ".self_attn.sinks"), None
        return
    prefix, mlp, rest = param_name.partition(".mlp.")
    if mlp and rest in _MLP_NAMES:
        hf, shard_id = _MLP_NAMES[rest]
        yield f"{prefix}.mlp.{hf}", shard_id
        return
    yield param_name, None


def tensor_shapes(spec: ModelSpec, layer_prefix: str) -> dict[str, tuple[int, ...]]:
    """Full HF shapes of one layer's MLP tensors and sinks."""
    m, h = spec.moe, spec.hidden_size
    e, i, p = m.num_experts, m.expert_intermediate_size, f"{layer_prefix}mlp."
    return {p + "router.weight": (e, h), p + "router.bias": (e,),
            p + "experts.gate_up_proj": (e, h, 2 * i), p + "experts.gate_up_proj_bias": (e, 2 * i),
            p + "experts.down_proj": (e, i, h), p + "experts.down_proj_bias": (e, h),
            f"{layer_prefix}self_attn.sinks": (spec.num_heads,)}
