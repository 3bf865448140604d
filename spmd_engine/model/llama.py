"""Llama-family causal LM (Llama, Mistral, Qwen2, Qwen3 and the MoE Mixtral,
Qwen2-MoE, Qwen3-MoE), one pipeline stage of it.

One class serves them all: they differ in which projections carry a bias,
whether q and k are RMS-normalised per head (Qwen3), and whether a layer's MLP
is dense or a sparse MoE block (moe_block.py), all read from config.json by
ModelSpec. A rank builds
only its stage: stage 0 owns the embedding, the last stage the final norm and
the LM head (for tied embeddings the last stage loads the embedding matrix as
its head), and every stage owns its layers' TP shards. Parameter names match
HF checkpoints except the fused `qkv_proj` / `gate_up_proj`, which
`checkpoint_tensors` maps back to the separate HF tensors.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from spmd_engine.config import ConfigError
from spmd_engine.model.attention import Attention, AttentionMetadata
from spmd_engine.model.embedding import ParallelLMHead, VocabParallelEmbedding
from spmd_engine.model.linear import QKVParallelLinear, RowParallelLinear
from spmd_engine.model.mlp import SwiGLUMLP
from spmd_engine.model.moe_block import SparseMoeBlock, hf_names, moe_tensor_shapes
from spmd_engine.model.norm import RMSNorm
from spmd_engine.model.partition import check_model_parallel, pp_layer_range
from spmd_engine.model.rotary import RotaryEmbedding, apply_rotary
from spmd_engine.model.shard import Loaded
from spmd_engine.model.spec import ModelSpec

# Our fused parameter -> the HF tensors it is made of, with each one's shard_id.
FUSED_PARAMETERS = {
    "qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
    "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
}


class WeightLoadError(ValueError):
    """A checkpoint tensor that does not fit the model (names the tensor)."""

    def __init__(self, tensor_name: str, reason: str):
        super().__init__(f"tensor {tensor_name}: {reason}")
        self.tensor_name = tensor_name


class LlamaAttention(nn.Module):
    def __init__(self, spec: ModelSpec, tp_group, dtype: torch.dtype):
        super().__init__()
        self.head_dim = spec.head_dim
        self.qkv_proj = QKVParallelLinear(spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads,
                                          tp_group, bias=spec.qkv_bias, dtype=dtype)
        self.o_proj = RowParallelLinear(spec.num_heads * spec.head_dim, spec.hidden_size, tp_group,
                                        bias=spec.o_bias, dtype=dtype)
        self.attn = Attention(self.qkv_proj.num_heads_per_rank, self.qkv_proj.num_kv_heads_per_rank,
                              spec.head_dim, spec.head_dim ** -0.5)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype=dtype) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype=dtype) if spec.qk_norm else None

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                attn: AttentionMetadata | None):
        """`rope`: this step's (cos, sin) from the model's RotaryEmbedding. `hidden` is
        [N, H] packed tokens with `attn`, or [B, T, H] rows without (no cache)."""
        lead = hidden.shape[:-1]
        qkv = self.qkv_proj(hidden)
        q_and_k = self.qkv_proj.q_size + self.qkv_proj.kv_size
        # q and k sit side by side in the fused output: rotate them in one pass.
        heads = [self.qkv_proj.num_heads_per_rank, self.qkv_proj.num_kv_heads_per_rank]
        qk = qkv[..., :q_and_k].view(*lead, -1, self.head_dim)
        if self.q_norm is not None:  # Qwen3: per-head RMSNorm of q and k before RoPE
            q, k = qk.split(heads, dim=-2)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=-2)
        q, k = apply_rotary(qk, *rope).split(heads, dim=-2)
        v = qkv[..., q_and_k:].view(*lead, -1, self.head_dim)
        return self.o_proj(self.attn(q, k, v, attn))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual stream travels beside the hidden state."""

    def __init__(self, spec: ModelSpec, tp_group, dtype: torch.dtype, layer: int = 0, moe: dict | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype=dtype)
        self.self_attn = LlamaAttention(spec, tp_group, dtype)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype=dtype)
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
    are computed once per step.
    """

    def __init__(self, spec: ModelSpec, tp_group, layer_range: tuple[int, int], first: bool, last: bool,
                 dtype: torch.dtype, moe: dict | None = None):
        super().__init__()
        self.embed_tokens = (VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, tp_group, dtype=dtype)
                             if first else None)
        # Keyed by the global layer index so parameter names match the checkpoint.
        self.layers = nn.ModuleDict(
            {str(i): LlamaDecoderLayer(spec, tp_group, dtype, i, moe) for i in range(*layer_range)}
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype=dtype) if last else None
        self.rotary_emb = RotaryEmbedding(spec.head_dim, spec.rope_theta, spec.rope_scaling)


class CausalLM(nn.Module):
    """One rank's part of a Llama-family model: its PP stage, its TP shard.

    Built from a HF config dict; parameters are allocated but not initialised
    (use `load_model`, or `load_weights`). `forward` runs this stage: the first
    stage embeds `input_ids`, later stages continue from `intermediate`; a
    non-last stage returns {"hidden_states", "residual"} for the next stage,
    the last returns {"hidden_states"} after the final norm, which
    `compute_logits` turns into full-vocabulary float32 logits.

    MoE layers shard their experts over `moe_group` (default: the TP group):
    by width, or whole experts with `expert_parallel` (then `moe_group` is the
    EP group); `dispatch_group` (the DP group, when the EP group spans DP
    replicas) is where tokens are all-gathered (see moe.py). A dense model
    ignores all three.
    """

    def __init__(self, hf_config: Mapping[str, Any], tp_group, pp_group, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", pp_partition: str | None = None, moe_group=None,
                 expert_parallel: bool = False, dispatch_group=None):
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
            self.model = LlamaModel(spec, tp_group, (self.start_layer, self.end_layer),
                                    self.is_first_stage, self.is_last_stage, dtype, moe)
            self.lm_head = (ParallelLMHead(spec.vocab_size, spec.hidden_size, tp_group, dtype=dtype)
                            if self.is_last_stage else None)
        self.tie_weights()

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
        window = self.spec.sliding_window
        if window is not None and max_model_len > window:
            raise ConfigError(
                f"max_model_len {max_model_len} exceeds this model's sliding_window {window}; "
                f"sliding-window attention is not implemented, use --max-model-len <= {window}"
            )

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        return (num_blocks, block_size, self.num_kv_heads_per_rank, self.spec.head_dim)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, zeros=torch.zeros) -> None:
        """Zeroed K and V blocks for every layer of this stage, bound to the layers."""
        shape = self.kv_cache_shape(num_blocks, block_size)
        self.bind_kv_cache([(zeros(shape, dtype=self.dtype, device=self.device),
                             zeros(shape, dtype=self.dtype, device=self.device)) for _ in self._attention_layers()])

    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(a.k_cache, a.v_cache) for a in self._attention_layers()]

    def bind_kv_cache(self, caches: list[tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """Give each layer its (K, V) block tensors, in layer order; None drops them."""
        layers = self._attention_layers()
        if caches is None:
            caches = [(None, None)] * len(layers)
        if len(caches) != len(layers):
            raise ValueError(f"{len(caches)} caches for {len(layers)} layers")
        for attention, (k, v) in zip(layers, caches):
            attention.set_kv_cache(k, v)

    # ---- compute ----
    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, attn: AttentionMetadata | None,
                intermediate: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Packed tokens [N] (ids and positions) with `attn`; [B, T] rows without a cache."""
        if self.is_first_stage:
            hidden, residual = self.model.embed_tokens(input_ids), None
        else:
            if intermediate is None:
                raise ValueError("a later pipeline stage needs `intermediate` from the previous stage")
            hidden, residual = intermediate["hidden_states"], intermediate["residual"]
        rope = self.model.rotary_emb.cos_sin(positions, hidden.dtype)
        for layer in self.model.layers.values():
            hidden, residual = layer(rope, hidden, residual, attn)
        if not self.is_last_stage:
            return {"hidden_states": hidden, "residual": residual}
        hidden, _ = self.model.norm(hidden, residual)
        return {"hidden_states": hidden}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] final hidden states -> [N, vocab_size] float32, identical on every TP rank."""
        if self.lm_head is None:
            raise RuntimeError("compute_logits runs on the last pipeline stage only")
        return self.lm_head.compute_logits(hidden)

    # ---- weights ----
    def tie_weights(self) -> None:
        """Share the embedding with the head when both live here (again after to_empty)."""
        if self.spec.tie_word_embeddings and self.is_first_stage and self.is_last_stage:
            self.lm_head.weight = self.model.embed_tokens.weight

    def checkpoint_tensors(self) -> Iterator[tuple[str, str, Any]]:
        """(HF tensor name, our parameter name, shard_id) for every tensor this rank needs."""
        for name, _ in self.named_parameters():
            if name == "lm_head.weight" and self.spec.tie_word_embeddings:
                yield "model.embed_tokens.weight", name, None
                continue
            fused = next((f for f in FUSED_PARAMETERS if f".{f}." in name), None)
            if fused is None:
                module = self.get_submodule(name.rpartition(".")[0])
                for hf_name, shard_id in (hf_names(self.spec, name, module) if self.spec.moe else [(name, None)]):
                    yield hf_name, name, shard_id
                continue
            for part, shard_id in FUSED_PARAMETERS[fused]:
                yield name.replace(f".{fused}.", f".{part}."), name, shard_id

    def load_weights(self, weights: Callable[[str], Loaded] | Iterable[tuple[str, Any]]
                     | Mapping[str, Any]) -> set[str] | None:
        """Fill parameters through their owning layers' weight_loaders.

        Two callers: the checkpoint loader passes `fetch(hf_name)` (a callable
        returning a tensor or a lazy safetensors slice; every parameter is
        filled and the layer reads only its shard). A trainer passes an
        iterable of `(hf_name, full_tensor)` pairs, or a state dict, to update
        weights in place (see `update_weights`).
        """
        if not callable(weights):
            return self.update_weights(weights)
        fetch = weights
        for tensor_name, param_name, shard_id in self.checkpoint_tensors():
            module_name, _, attr = param_name.rpartition(".")
            module = self.get_submodule(module_name)
            loaded = fetch(tensor_name)
            try:
                module.weight_loader(getattr(module, attr), loaded, shard_id)
            except ValueError as exc:
                raise WeightLoadError(tensor_name, str(exc)) from None

    # ---- in-place updates (RL trainers push new weights after each optimizer step) ----
    def update_weights(self, weights: Iterable[tuple[str, Any]] | Mapping[str, Any]) -> set[str]:
        """Copy full (unsharded) HF-named tensors into this rank's existing parameters.

        Pairs may come in any order, one per call or all at once; a DTensor is
        gathered with `full_tensor()`. Each name and full shape is checked
        against the whole model (`hf_tensor_shapes`) on every rank, so a bad
        pair fails identically everywhere with a ValueError naming it, before
        it writes anything (pairs before it stay applied). A valid name of
        another pipeline stage is skipped. Fused `qkv_proj` / `gate_up_proj`
        take their q/k/v and gate/up parts; with tied embeddings the embedding
        also feeds the LM head (and `lm_head.weight` is accepted for it).
        Weights packed for oneDNN are unpacked, written and packed again.
        Returns the names this rank copied from. The KV cache still holds keys
        and values of the old weights: callers reset the prefix cache.
        """
        if isinstance(weights, Mapping):
            weights = weights.items()
        if self.weights_discarded:  # asleep at level 2: this load brings the weights back
            self.allocate_discarded_weights()
        shapes = hf_tensor_shapes(self.spec)
        targets = self._update_targets()
        dense: dict[nn.Module, torch.Tensor] = {}  # packed modules being written, by module
        loaded: set[str] = set()
        try:
            for name, tensor in weights:
                if not isinstance(name, str):
                    raise ValueError(f"load_weights expects (name, tensor) pairs, got a name {name!r}")
                if _skipped_name(name):
                    continue
                if name not in shapes:
                    raise ValueError(f"load_weights: unknown weight name {name!r} (not a tensor of this "
                                     f"{self.spec.architecture} model)")
                if hasattr(tensor, "full_tensor"):
                    tensor = tensor.full_tensor()
                if not isinstance(tensor, torch.Tensor):
                    raise ValueError(f"load_weights: {name} is a {type(tensor).__name__}, not a tensor")
                if tuple(tensor.shape) != shapes[name]:
                    raise ValueError(f"load_weights: {name} has shape {list(tensor.shape)}, "
                                     f"expected {list(shapes[name])}")
                for param_name, shard_id in targets.get(name, ()):
                    module_name, _, attr = param_name.rpartition(".")
                    module = self.get_submodule(module_name)
                    param = getattr(module, attr)
                    if param.is_mkldnn:
                        param = dense.get(module)
                        if param is None:
                            param = dense[module] = getattr(module, attr).to_dense()
                    with torch.no_grad():
                        module.weight_loader(param, tensor.detach(), shard_id)
                    loaded.add(name)
                    self._mark_written(name)
        finally:
            from spmd_engine.model.packed_weights import repack
            for module, tensor in dense.items():
                repack(module, tensor)
        return loaded

    # ---- sleep mode: weights given back and restored ----
    # HF names of this rank's tensors with no value since discard_weights (None: all have one).
    _unwritten: set[str] | None = None
    # True from discard_weights until any tensor is loaded: only then does reload_weights read
    # the checkpoint (after a trainer's load it would throw the trainer's update away).
    reload_pending = False

    @property
    def needs_weights(self) -> bool:
        """Some tensor of this rank has had no value since the weights were discarded."""
        return bool(self._unwritten)

    def unwritten_weights(self) -> list[str]:
        return sorted(self._unwritten or ())

    def _mark_written(self, name: str) -> None:
        if self._unwritten:
            self._unwritten.discard(name)
            if name == "lm_head.weight" and self.spec.tie_word_embeddings:
                self._unwritten.discard("model.embed_tokens.weight")  # the same tensor
        self.reload_pending = False

    @property
    def weights_discarded(self) -> bool:
        return bool(getattr(self, "_discarded", None))

    def _unique_parameters(self) -> Iterator[tuple[nn.Module, str, nn.Parameter]]:
        seen: set[int] = set()
        for module in self.modules():
            for attr, param in module._parameters.items():
                if param is not None and id(param) not in seen:
                    seen.add(id(param))
                    yield module, attr, param

    def discard_weights(self) -> None:
        """Free every parameter's storage (sleep level 2), keeping what it takes to allocate it
        again; the values are gone until the next load (`update_weights` allocates first)."""
        if self.weights_discarded:
            return
        discarded = []
        for module, attr, param in self._unique_parameters():
            discarded.append((module, attr, tuple(param.shape), param.dtype, param.device, param.is_mkldnn))
            if param.is_mkldnn:  # a packed tensor's storage cannot be swapped: replace the Parameter
                module._parameters[attr] = nn.Parameter(torch.empty(0, dtype=param.dtype), requires_grad=False)
            else:  # keeps a tied embedding and head one Parameter
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self._discarded = discarded
        for module in self.modules():  # packed copies of MoE experts go too
            if hasattr(module, "drop_packed"):
                module.drop_packed()
        self._unwritten = {hf_name for hf_name, _, _ in self.checkpoint_tensors()}
        self.reload_pending = True

    def allocate_discarded_weights(self) -> None:
        """Storage again for discarded parameters, uninitialised (packed ones packed again)."""
        from spmd_engine.model.packed_weights import repack
        for module, attr, shape, dtype, device, packed in getattr(self, "_discarded", None) or ():
            dense = torch.empty(shape, dtype=dtype, device=device)
            if packed:
                repack(module, dense)
            else:
                getattr(module, attr).data = dense
        self._discarded = None

    def move_weights(self, device: str | torch.device) -> None:
        """Every parameter to `device` in place (sleep level 1 on an accelerator: to host memory)."""
        for _, _, param in self._unique_parameters():
            param.data = param.data.to(device)

    def _update_targets(self) -> dict[str, list[tuple[str, Any]]]:
        """HF name -> [(our parameter, shard_id)] for the tensors this rank holds."""
        targets: dict[str, list[tuple[str, Any]]] = {}
        for tensor_name, param_name, shard_id in self.checkpoint_tensors():
            targets.setdefault(tensor_name, []).append((param_name, shard_id))
        if self.spec.tie_word_embeddings and self.lm_head is not None:
            # A tied embedding reaches the head as `model.embed_tokens.weight` (above); a trainer's
            # state dict also carries the same tensor as `lm_head.weight`.
            targets["lm_head.weight"] = [("lm_head.weight", None)]
        return targets


def _skipped_name(name: str) -> bool:
    """Buffers some checkpoints and state dicts carry that are no weights here."""
    return name.endswith("rotary_emb.inv_freq") or name.endswith("rotary_emb.cos_cached") \
        or name.endswith("rotary_emb.sin_cached")


def hf_tensor_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of the whole model (all stages) with its full, unsharded shape."""
    h, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,),
              "lm_head.weight": (spec.vocab_size, h)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
        })
        if spec.is_moe_layer(i):
            shapes.update(moe_tensor_shapes(spec, p))
        else:
            shapes.update({p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                           p + "mlp.down_proj.weight": (h, inter)})
        if spec.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        if spec.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if spec.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if spec.mlp_bias:
            shapes.update({p + "mlp.gate_proj.bias": (inter,), p + "mlp.up_proj.bias": (inter,),
                           p + "mlp.down_proj.bias": (h,)})
    return shapes
