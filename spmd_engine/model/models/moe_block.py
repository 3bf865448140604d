"""The sparse MLP of an MoE decoder layer, and its HF tensor names.

Router (a replicated [experts, hidden] matrix; gpt-oss: with a bias, its top-k logits
softmaxed), the experts (FusedMoE; gpt-oss: with biases and the clamped SwiGLU) and,
in Qwen2-MoE, a shared expert (a TP-split SwiGLU MLP) scaled by
sigmoid(shared_expert_gate(x)); in DeepSeek, shared experts without a gate
(`shared_experts`) and a float32 router choosing within groups of experts
(grouped_routing.py). Our parameters sit under `mlp.` for every
architecture; `hf_names` maps them to the checkpoint's per-expert tensors
(Mixtral: `block_sparse_moe.experts.E.w1/w3/w2`, Qwen: `mlp.experts.E.
gate_proj/up_proj/down_proj`), listing only the experts this rank holds, so
a rank never reads another rank's experts.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from spmd_engine.kernels.packed_weights import linear
from spmd_engine.model.layers import batch_invariant as bi
from spmd_engine.model.layers.fused_moe import FusedMoE
from spmd_engine.model.layers.grouped_routing import grouped_route
from spmd_engine.model.layers.mlp import SwiGLUMLP
from spmd_engine.model.layers.moe_routing import route, route_topk_logits
from spmd_engine.model.models import gpt_oss
from spmd_engine.model.shard import replicated_weight_loader
from spmd_engine.model.spec import ModelSpec

QWEN_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class ReplicatedLinear(nn.Module):
    """A small matrix every rank holds whole (router, shared-expert gate); packed for oneDNN
    on CPU like the parallel linears (packed_weights.py)."""

    weight_loader = staticmethod(replicated_weight_loader)
    packable_weight = True
    batch_invariant = False

    def __init__(self, input_size: int, output_size: int, dtype: torch.dtype | None = None, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (bi.linear if self.batch_invariant else linear)(x, self.weight, self.bias)


class SparseMoeBlock(nn.Module):
    batch_invariant = False  # the shared expert's gate through batch_invariant.pointwise

    def __init__(self, spec: ModelSpec, tp_group, moe_group, expert_parallel: bool, dispatch_group=None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        m = spec.moe
        self.moe = m
        # DeepSeek's router runs in float32 whatever the model's dtype (as transformers keeps it).
        self.gate = ReplicatedLinear(spec.hidden_size, m.num_experts, dtype=torch.float32 if m.grouped else dtype,
                                     bias=m.router_bias)
        if m.grouped is not None and m.grouped.correction_bias:
            self.gate.e_score_correction_bias = nn.Parameter(torch.empty(m.num_experts, dtype=torch.float32),
                                                             requires_grad=False)
        self.experts = FusedMoE(m.num_experts, spec.hidden_size, m.expert_intermediate_size, moe_group,
                                expert_parallel=expert_parallel, dispatch_group=dispatch_group, dtype=dtype,
                                bias=m.expert_bias, swiglu_limit=m.swiglu_limit, swiglu_alpha=m.swiglu_alpha)
        self.shared_expert = self.shared_expert_gate = self.shared_experts = None
        if m.shared_expert_intermediate_size:
            mlp = SwiGLUMLP(spec.hidden_size, m.shared_expert_intermediate_size, tp_group, dtype=dtype)
            if m.shared_expert_gated:
                self.shared_expert, self.shared_expert_gate = mlp, ReplicatedLinear(spec.hidden_size, 1, dtype=dtype)
            else:  # DeepSeek's name for them: `mlp.shared_experts.*` in its checkpoints
                self.shared_experts = mlp
        # Routing replay (CausalLM.record_routing): the last forward's expert ids [T, k], global
        # numbering, best first; kept only when asked, so a normal step holds nothing extra.
        self.record_routing = False
        self.routed_ids: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        lead = hidden.shape[:-1]
        x = hidden.reshape(-1, hidden.shape[-1])
        if self.moe.softmax_after_topk:
            weights, ids = route_topk_logits(self.gate(x), self.moe.top_k)
        elif self.moe.grouped is not None:
            weights, ids = grouped_route(self.gate(x.float()), self.moe.top_k, self.moe.grouped,
                                         getattr(self.gate, "e_score_correction_bias", None), self.batch_invariant)
        else:
            weights, ids = route(self.gate(x), self.moe.top_k, self.moe.renormalize,
                                 self.moe.weights_in_activation_dtype)
        if self.record_routing:
            self.routed_ids = ids
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            sigmoid = (lambda v: bi.pointwise(torch.sigmoid, v)) if self.batch_invariant else torch.sigmoid
            out = out + sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(*lead, -1)


def _layer_prefix(param_name: str) -> str:
    return param_name[: param_name.index(".mlp.") + 1]


def hf_expert_name(spec: ModelSpec, layer_prefix: str, expert: int, part: str) -> str:
    if spec.moe.checkpoint_style == "mixtral":
        return f"{layer_prefix}block_sparse_moe.experts.{expert}.{part}.weight"
    return f"{layer_prefix}mlp.experts.{expert}.{QWEN_PARTS[part]}.weight"


def hf_names(spec: ModelSpec, param_name: str, module: nn.Module) -> Iterator[tuple[str, object]]:
    """(HF tensor name, shard_id) feeding one of our MoE parameters on this rank."""
    if spec.moe.checkpoint_style == "gpt_oss":
        yield from gpt_oss.hf_names(param_name)
        return
    if ".mlp." not in param_name:
        yield param_name, None
        return
    prefix = _layer_prefix(param_name)
    if param_name.endswith(".experts.w13_weight") or param_name.endswith(".experts.w2_weight"):
        parts = ("w2",) if param_name.endswith("w2_weight") else ("w1", "w3")
        for expert in module.local_experts:
            for part in parts:
                yield hf_expert_name(spec, prefix, expert, part), (part, expert)
    elif param_name.endswith(".mlp.gate.weight") and spec.moe.checkpoint_style == "mixtral":
        yield f"{prefix}block_sparse_moe.gate.weight", None
    else:
        yield param_name, None


def moe_tensor_shapes(spec: ModelSpec, layer_prefix: str) -> dict[str, tuple[int, ...]]:
    """Full HF shapes of one sparse layer's MLP tensors."""
    m, h = spec.moe, spec.hidden_size
    if m.checkpoint_style == "gpt_oss":
        return gpt_oss.tensor_shapes(spec, layer_prefix)
    gate = (f"{layer_prefix}block_sparse_moe.gate.weight" if m.checkpoint_style == "mixtral"
            else f"{layer_prefix}mlp.gate.weight")
    shapes = {gate: (m.num_experts, h)}
    if m.grouped is not None and m.grouped.correction_bias:
        shapes[f"{layer_prefix}mlp.gate.e_score_correction_bias"] = (m.num_experts,)
    for expert in range(m.num_experts):
        for part in ("w1", "w3"):
            shapes[hf_expert_name(spec, layer_prefix, expert, part)] = (m.expert_intermediate_size, h)
        shapes[hf_expert_name(spec, layer_prefix, expert, "w2")] = (h, m.expert_intermediate_size)
    if m.shared_expert_intermediate_size:
        s = m.shared_expert_intermediate_size
        p = f"{layer_prefix}mlp.shared_expert{'' if m.shared_expert_gated else 's'}."
        shapes.update({p + "gate_proj.weight": (s, h), p + "up_proj.weight": (s, h), p + "down_proj.weight": (h, s)})
        if m.shared_expert_gated:
            shapes[f"{layer_prefix}mlp.shared_expert_gate.weight"] = (1, h)
    return shapes
