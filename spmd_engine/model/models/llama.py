"""Llama-family causal LM (Llama, Mistral, Qwen2, Qwen3 and the MoE Mixtral,
Qwen2-MoE, Qwen3-MoE, gpt-oss (gpt_oss.py)), one pipeline stage of it.

One class serves them all: they differ in which projections carry a bias,
whether q and k are RMS-normalised per head (Qwen3), and whether a layer's MLP
is dense or a sparse MoE block (moe_block.py), all read from config.json by
ModelSpec. A rank builds
only its stage: stage 0 owns the embedding, the last stage the final norm and
the LM head (for tied embeddings the last stage loads the embedding matrix as
its head), and every stage owns its layers' TP shards. Parameter names match
HF checkpoints except the fused `qkv_proj` / `gate_up_proj`, which
`checkpoint_tensors` (model/weights.py) maps back to the separate HF tensors
(or reads whole, for checkpoints that store them fused: Phi-3). Families
whose layers differ subclass what differs and name it in a class attribute
(`CausalLM.model_class`, `LlamaModel.decoder_layer` / `norm_class` / `embedding` /
`rotary`, `LlamaDecoderLayer.attention_class`, `LlamaAttention.norm_qk`: models/gemma3.py,
olmo2.py, deepseek.py).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from spmd_engine.compilation.compiled_layers import CompiledLayers
from spmd_engine.model.layers.attention import Attention, AttentionMetadata
from spmd_engine.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from spmd_engine.model.layers.linear import QKVParallelLinear, RowParallelLinear
from spmd_engine.model.layers.longrope import LongRopeEmbedding
from spmd_engine.model.layers.mlp import SwiGLUMLP
from spmd_engine.model.layers.norm import RMSNorm
from spmd_engine.model.layers.rotary import RotaryEmbedding, apply_rotary, rope_type_of
from spmd_engine.model.layers.sink_attention import AttentionSinks
from spmd_engine.model.models.moe_block import SparseMoeBlock
from spmd_engine.model.partition import check_model_parallel, pp_layer_range
from spmd_engine.model.spec import ModelSpec
from spmd_engine.model.weights import CausalLMWeights


class LlamaAttention(nn.Module):
    """`norm` builds the per-head q/k norms (where spec.qk_norm), `scale` is the softmax's
    (default head_dim ** -0.5): Gemma 3 passes its own of both (models/gemma3.py)."""

    def __init__(self, spec: ModelSpec, tp_group, dtype: torch.dtype, sliding_window: int | None = None,
                 norm=RMSNorm, scale: float | None = None):
        super().__init__()
        self.head_dim = spec.head_dim
        self.qkv_proj = QKVParallelLinear(spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads,
                                          tp_group, bias=spec.qkv_bias, dtype=dtype)
        self.o_proj = RowParallelLinear(spec.num_heads * spec.head_dim, spec.hidden_size, tp_group,
                                        bias=spec.o_bias, dtype=dtype)
        sinks = AttentionSinks(spec.num_heads, tp_group, dtype=dtype) if spec.attention_sinks else None
        self.attn = Attention(self.qkv_proj.num_heads_per_rank, self.qkv_proj.num_kv_heads_per_rank,
                              spec.head_dim, spec.head_dim ** -0.5 if scale is None else scale,
                              sliding_window, sinks)
        self.q_norm = norm(spec.head_dim, spec.rms_norm_eps, dtype=dtype) if spec.qk_norm else None
        self.k_norm = norm(spec.head_dim, spec.rms_norm_eps, dtype=dtype) if spec.qk_norm else None

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                attn: AttentionMetadata | None):
        """`rope`: this step's (cos, sin) from the model's RotaryEmbedding. `hidden` is
        [N, H] packed tokens with `attn`, or [B, T, H] rows without (no cache)."""
        lead = hidden.shape[:-1]
        qkv = self.qkv_proj(hidden)
        q_and_k = self.qkv_proj.q_size + self.qkv_proj.kv_size
        # q and k sit side by side in the fused output: rotate them in one pass (cast back: a
        # family may rotate in float32).
        heads = [self.qkv_proj.num_heads_per_rank, self.qkv_proj.num_kv_heads_per_rank]
        qk = self.norm_qk(qkv[..., :q_and_k]).view(*lead, -1, self.head_dim)
        q, k = apply_rotary(qk, *rope).to(qkv.dtype).split(heads, dim=-2)
        v = qkv[..., q_and_k:].view(*lead, -1, self.head_dim)
        return self.o_proj(self.attn(q, k, v, attn))

    def norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        """q and k side by side [..., q_size + kv_size], normed before RoPE where the family
        norms them (Qwen3: each head alone)."""
        if self.q_norm is None:
            return qk
        q, k = qk.unflatten(-1, (-1, self.head_dim)).split(
            [self.qkv_proj.num_heads_per_rank, self.qkv_proj.num_kv_heads_per_rank], dim=-2)
        return torch.cat([self.q_norm(q), self.k_norm(k)], dim=-2).flatten(-2)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual stream travels beside the hidden state."""

    attention_class = LlamaAttention  # a family's subclass may swap these (models/olmo2.py, deepseek.py)
    norm_class = RMSNorm

    def __init__(self, spec: ModelSpec, tp_group, dtype: torch.dtype, layer: int = 0, moe: dict | None = None):
        super().__init__()
        self.input_layernorm = self.norm_class(spec.hidden_size, spec.rms_norm_eps, dtype=dtype)
        self.self_attn = self.attention_class(spec, tp_group, dtype, spec.window(layer))
        self.post_attention_layernorm = self.norm_class(spec.hidden_size, spec.rms_norm_eps, dtype=dtype)
        if spec.is_moe_layer(layer):
            self.mlp = SparseMoeBlock(spec, tp_group, dtype=dtype, **(moe or {"moe_group": tp_group,
                                                                              "expert_parallel": False}))
        else:
            self.mlp = SwiGLUMLP(spec.hidden_size, spec.intermediate_size, tp_group, bias=spec.mlp_bias,
                                 dtype=dtype)

    def forward(self, rope, hidden, residual, attn):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, attn)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """The `model.` prefix of HF checkpoints: embedding, this stage's layers, norm.

    One RotaryEmbedding serves every layer (it has no weights): its cos/sin
    are computed once per step. A family's subclass names its own parts (the class
    attributes below, `rotary`).
    """

    embedding = VocabParallelEmbedding
    decoder_layer = LlamaDecoderLayer
    norm_class = RMSNorm

    def __init__(self, spec: ModelSpec, tp_group, layer_range: tuple[int, int], first: bool, last: bool,
                 dtype: torch.dtype, moe: dict | None = None):
        super().__init__()
        self.embed_tokens = (self.embedding(spec.vocab_size, spec.hidden_size, tp_group, dtype=dtype)
                             if first else None)
        # Keyed by the global layer index so parameter names match the checkpoint.
        self.layers = nn.ModuleDict(
            {str(i): self.decoder_layer(spec, tp_group, dtype, i, moe) for i in range(*layer_range)}
        )
        self.norm = self.norm_class(spec.hidden_size, spec.rms_norm_eps, dtype=dtype) if last else None
        self.rotary_emb = self.rotary(spec)

    @staticmethod
    def rotary(spec: ModelSpec) -> nn.Module:
        """What computes each step's rope tables (`cos_sin`), handed to every layer."""
        if rope_type_of(spec.rope_scaling) == "longrope":
            return LongRopeEmbedding(spec.head_dim, spec.rope_theta, spec.rope_scaling, spec.rotary_dim)
        return RotaryEmbedding(spec.head_dim, spec.rope_theta, spec.rope_scaling,
                               spec.max_position_embeddings, rotary_dim=spec.rotary_dim)


class CausalLM(CausalLMWeights, nn.Module):
    """One rank's part of a Llama-family model: its PP stage, its TP shard.

    Built from a HF config dict; parameters are allocated but not initialised
    (use `load_model`, or `load_weights`). `forward` runs this stage: the first
    stage embeds `input_ids`, later stages continue from `intermediate`; a
    non-last stage returns {"hidden_states", "residual"} for the next stage,
    the last returns {"hidden_states"} after the final norm, which
    `compute_logits` turns into full-vocabulary float32 logits. With `batch_invariant` every
    layer uses batch_invariant.py's kernels: a row's result depends on that row alone (any
    batch, cache state, TP size), and a forward without a cache is a trainer's (autograd). With `record_routing()` both
    also carry "routed_experts", the sparse layers' expert ids so far (routing replay).

    MoE layers shard their experts over `moe_group` (default: the TP group):
    by width, or whole experts with `expert_parallel` (then `moe_group` is the
    EP group); `dispatch_group` (the DP group, when the EP group spans DP
    replicas) is where tokens are all-gathered (see moe.py). A dense model
    ignores all three.
    """

    # A subclass registered (model/registry.py) under an architecture name of its own: the
    # built-in architecture whose config.json reading it follows (None: LlamaForCausalLM's).
    hf_config_architecture: str | None = None
    # The `model.` module's class: a family's subclass of LlamaModel (models/gemma3.py).
    model_class = LlamaModel

    def __init__(self, hf_config: Mapping[str, Any], tp_group, pp_group, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", pp_partition: str | None = None, moe_group=None,
                 expert_parallel: bool = False, dispatch_group=None, batch_invariant: bool = False):
        super().__init__()
        moe_group = moe_group if moe_group is not None else tp_group
        spec = check_model_parallel(hf_config, tp_group.world_size, pp_group.world_size,
                                    ep_size=moe_group.world_size if expert_parallel else None)
        self.spec = spec
        self.tp_group = tp_group
        self.pp_group = pp_group
        self.is_first_stage = pp_group.is_first_rank
        self.is_last_stage = pp_group.is_last_rank
        self.start_layer, self.end_layer = pp_layer_range(spec.num_layers, pp_group.rank_in_group,
                                                          pp_group.world_size, pp_partition)
        with torch.device(device):
            moe = dict(moe_group=moe_group, expert_parallel=expert_parallel, dispatch_group=dispatch_group)
            self.model = self.model_class(spec, tp_group, (self.start_layer, self.end_layer),
                                          self.is_first_stage, self.is_last_stage, dtype, moe)
            self.lm_head = (ParallelLMHead(spec.vocab_size, spec.hidden_size, tp_group, dtype=dtype)
                            if self.is_last_stage else None)
        self.tie_weights()
        self.batch_invariant = batch_invariant
        for module in self.modules():  # the layers with a batch-invariant form (batch_invariant.py)
            if hasattr(type(module), "batch_invariant") and module is not self:
                module.batch_invariant = batch_invariant

    # ---- shape facts the worker needs to size the KV cache ----
    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def num_kv_heads_per_rank(self) -> int:
        return self._attention_layers()[0].num_kv_heads

    def _attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers.values()]

    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer of this stage, this rank's heads."""
        per_layer = 2 * self.num_kv_heads_per_rank * self.spec.head_dim
        return per_layer * len(self.model.layers) * self.dtype.itemsize

    def check_max_model_len(self, max_model_len: int) -> None:
        """Any length: a sliding-window layer attends over its window at every length (the limit
        this hook once set), its cache freeing what falls out of it (core/kv_cache_manager.py)."""

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        return (num_blocks, block_size, self.num_kv_heads_per_rank, self.spec.head_dim)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, zeros=torch.zeros) -> None:
        """Zeroed K and V blocks for every layer of this stage, bound to the layers."""
        shape = self.kv_cache_shape(num_blocks, block_size)
        self.bind_kv_cache([(zeros(shape, dtype=self.dtype, device=self.device),
                             zeros(shape, dtype=self.dtype, device=self.device)) for _ in self._attention_layers()])

    def bind_kv_cache(self, caches: list[tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """Give each layer its (K, V) block tensors, in layer order; None drops them."""
        layers = self._attention_layers()
        if caches is None:
            caches = [(None, None)] * len(layers)
        if len(caches) != len(layers):
            raise ValueError(f"{len(caches)} caches for {len(layers)} layers")
        for attention, (k, v) in zip(layers, caches):
            attention.set_kv_cache(k, v)
        if self.compiled_layers is not None:
            self.compiled_layers.mark_caches_dynamic(layers)

    # ---- compute ----
    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, attn: AttentionMetadata | None,
                intermediate: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Packed tokens [N] (ids and positions) with `attn`; [B, T] rows without a cache. `attn` may
        also be a DecodeStep itself (one new token per row, worker/decode_graphs.py)."""
        if self.is_first_stage:
            hidden, residual = self.model.embed_tokens(input_ids), None
        else:
            if intermediate is None:
                raise ValueError("a later pipeline stage needs `intermediate` from the previous stage")
            hidden, residual = intermediate["hidden_states"], intermediate["residual"]
        rope = self.model.rotary_emb.cos_sin(positions, hidden.dtype, attn)
        compiled, normed = self.compiled_layers, None
        # A compiled model built without its LoRA layers cannot serve a step with adapters.
        lora_on = self.lora_state is not None and self.lora_state.mapping is not None and not compiled.lora \
            if compiled is not None else False
        if compiled is not None and attn is not None and not lora_on and compiled.applies(attn):
            hidden, residual, normed = compiled.run(rope, hidden, residual, attn)  # normed: the graph's final norm
        else:
            for layer in self.model.layers.values():
                hidden, residual = layer(rope, hidden, residual, attn)
        out = {} if not self.routing_recorded else {"routed_experts": self._routed_experts(intermediate, hidden)}
        if not self.is_last_stage:
            return {"hidden_states": hidden, "residual": residual, **out}
        if normed is None:
            normed, _ = self.model.norm(hidden, residual)
        return {"hidden_states": normed, **out}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] final hidden states -> [N, vocab_size] float32, identical on every TP rank."""
        if self.lm_head is None:
            raise RuntimeError("compute_logits runs on the last pipeline stage only")
        return self.lm_head.compute_logits(hidden)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N] int64: argmax of compute_logits(hidden) per row, without the logits where the LM
        head can (ParallelLMHead.greedy_tokens)."""
        if self.lm_head is None:
            raise RuntimeError("greedy_tokens runs on the last pipeline stage only")
        if type(self).compute_logits is not CausalLM.compute_logits:  # a registered subclass's own logits
            from spmd_engine.model.layers.greedy import greedy_tokens
            return greedy_tokens(self.compute_logits(hidden))
        return self.lm_head.greedy_tokens(hidden)

    # ---- LoRA adapters (model/lora/): their LoRAState, set by the LoRAManager ----
    lora_state = None

    # ---- compiled forward (compilation/compiled_layers.py) ----
    compiled_layers: "CompiledLayers | None" = None

    def compile_layers(self, **options) -> None:
        """From now on packed steps of at least `min_tokens` tokens run the decoder layers
        through torch.compile (CompiledLayers' options)."""
        self.compiled_layers = CompiledLayers(self, **options)
        self.compiled_layers.mark_caches_dynamic(self._attention_layers())

    # ---- routing replay ----
    routing_recorded = False

    def record_routing(self, on: bool = True) -> None:
        """From now on every forward also returns "routed_experts": [N, MoE layers so far, k]
        int32 expert ids (global numbering, best first), the earlier stages' layers (from
        `intermediate`) then this stage's, in layer order; the last stage holds them all."""
        self.routing_recorded = on
        for block in self._moe_blocks():
            block.record_routing = on

    def _moe_blocks(self) -> list[SparseMoeBlock]:
        return [layer.mlp for layer in self.model.layers.values() if isinstance(layer.mlp, SparseMoeBlock)]

    def _routed_experts(self, intermediate, hidden: torch.Tensor) -> torch.Tensor:
        # int32 in transit: NCCL has no int16 for the PP hand-off.
        parts = [block.routed_ids.to(torch.int32).unsqueeze(1) for block in self._moe_blocks()]
        if intermediate is not None and "routed_experts" in intermediate:
            parts.insert(0, intermediate["routed_experts"])
        if not parts:  # a stage without a sparse layer (mlp_only_layers), and none before it
            rows = hidden.reshape(-1, hidden.shape[-1]).shape[0]
            return torch.empty(rows, 0, self.spec.moe.top_k, dtype=torch.int32, device=hidden.device)
        return torch.cat(parts, dim=1)

    # ---- weights ----
    def tie_weights(self) -> None:
        """Share the embedding with the head when both live here (again after to_empty)."""
        if self.spec.tie_word_embeddings and self.is_first_stage and self.is_last_stage:
            self.lm_head.weight = self.model.embed_tokens.weight
