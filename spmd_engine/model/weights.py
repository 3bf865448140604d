"""A causal LM's weights: HF tensor names, loading, in-place updates and sleep memory.

The model classes own their layers; this mixin owns how those layers' parameters
meet the outside world: a checkpoint (every tensor read through the owning
layer's weight_loader, so a rank reads only its shard), a trainer pushing new
weights in place (full HF-named tensors, checked against the whole model's
shapes so a bad pair fails identically on every rank), and sleep mode (storage
given back and allocated again, with a record of which tensors have had no value
since, so an engine never serves a half-restored model).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from spmd_engine.kernels.packed_weights import dense_shape, is_packed
from spmd_engine.model.layers.linear import FUSED
from spmd_engine.model.models.moe_block import hf_names, moe_tensor_shapes
from spmd_engine.model.shard import Loaded
from spmd_engine.model.spec import ModelSpec

# Our fused parameter -> the HF tensors it is made of, with each one's shard_id (a checkpoint
# with `fused_checkpoint`, Phi-3's, holds the fused tensor itself: shard_id FUSED).
FUSED_PARAMETERS = {
    "qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
    "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
}


class WeightLoadError(ValueError):
    """A checkpoint tensor that does not fit the model (names the tensor)."""

    def __init__(self, tensor_name: str, reason: str):
        super().__init__(f"tensor {tensor_name}: {reason}")
        self.tensor_name = tensor_name


class CausalLMWeights:
    """Mixed into CausalLM (an nn.Module with `spec`, `lm_head` and the stage flags)."""

    def checkpoint_tensors(self) -> Iterator[tuple[str, str, Any]]:
        """(HF tensor name, our parameter name, shard_id) for every tensor this rank needs."""
        for name, _ in self.named_parameters():
            if name == "lm_head.weight" and self.spec.tie_word_embeddings:
                yield "model.embed_tokens.weight", name, None
                continue
            fused = next((f for f in FUSED_PARAMETERS if f".{f}." in name), None)
            if fused is not None and self.spec.fused_checkpoint:
                yield name, name, FUSED
                continue
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
        Packed weights are written in place, or for oneDNN unpacked, written and packed again.
        Returns the names this rank copied from. The KV cache still holds keys
        and values of the old weights: callers reset the prefix cache.
        """
        with self.open_weight_update() as update:
            return update.apply(weights)

    def open_weight_update(self, expected: Iterable[str] | None = None):
        """An in-place update applied over several calls (`.apply(pairs)`, update_weights'
        contract; model/in_place_update.py); packs what is left when closed. `expected`: the
        names the caller will send, each checked against the model beforehand."""
        from spmd_engine.model.in_place_update import InPlaceUpdate
        return InPlaceUpdate(self, expected)

    # ---- versioned updates (LLM.start_weight_update / finish_weight_update) ----
    _update_in_progress = False
    _update_error: str | None = None  # the first load that failed during the update in progress

    def begin_update(self) -> None:
        """An update starts: loads are watched until end_update."""
        self._update_in_progress, self._update_error = True, None

    def note_update_error(self, reason: str) -> None:
        """A load that failed outside update_weights (a weight transfer that broke or was
        refused): the update in progress cannot complete, as with a failed load_weights."""
        if self._update_in_progress and self._update_error is None:
            self._update_error = reason

    def end_update(self) -> str | None:
        """Close the update; the reason this rank cannot serve it (a failed load, or tensors
        without a value: left out of a recovery or of a restore after sleep), or None. On any
        rank's reason the front end marks every rank's weights mixed (mark_weights_mixed)."""
        error, self._update_in_progress, self._update_error = self._update_error, False, None
        if error is None and self._unwritten:
            missing = sorted(self._unwritten)
            error = f"{len(missing)} tensors not loaded (first: {missing[0]})"
        return error

    def mark_weights_mixed(self) -> None:
        """Every tensor of this rank counts as having no trusted value until written again (an
        update failed here or on another rank of the replica)."""
        self._update_in_progress, self._update_error = False, None
        self._unwritten = {hf_name for hf_name, _, _ in self.checkpoint_tensors()}

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
            discarded.append((module, attr, dense_shape(param), param.dtype, param.device, is_packed(param)))
            if is_packed(param):  # an oneDNN tensor's storage cannot be swapped: replace the Parameter
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
        from spmd_engine.kernels.packed_weights import repack
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


def is_skipped_name(name: str) -> bool:
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
        shapes.update({p + norm + ".weight": (h,) for norm in spec.layer_norm_names()})
        if spec.mla is not None:
            shapes.update(spec.mla.tensor_shapes(p, h, spec.num_heads))
        else:
            shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                           p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q)})
        if spec.is_moe_layer(i):
            shapes.update(moe_tensor_shapes(spec, p))
        else:
            shapes.update({p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                           p + "mlp.down_proj.weight": (h, inter)})
        if spec.qk_norm:
            whole = spec.qk_norm_over == "projection"
            shapes.update({p + "self_attn.q_norm.weight": (q if whole else d,),
                           p + "self_attn.k_norm.weight": (kv if whole else d,)})
        if spec.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if spec.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if spec.mlp_bias:
            shapes.update({p + "mlp.gate_proj.bias": (inter,), p + "mlp.up_proj.bias": (inter,),
                           p + "mlp.down_proj.bias": (h,)})
        if spec.fused_checkpoint:
            _fuse_shapes(shapes, p)
    return shapes


def _fuse_shapes(shapes: dict[str, tuple[int, ...]], layer_prefix: str) -> None:
    """A fused checkpoint's names in place of the separate ones: each fused tensor its parts
    stacked along the rows."""
    for fused, parts in FUSED_PARAMETERS.items():
        module = "self_attn." if fused == "qkv_proj" else "mlp."
        for kind in ("weight", "bias"):
            names = [f"{layer_prefix}{module}{part}.{kind}" for part, _ in parts]
            if all(n in shapes for n in names):
                part_shapes = [shapes.pop(n) for n in names]
                shapes[f"{layer_prefix}{module}{fused}.{kind}"] = (sum(ps[0] for ps in part_shapes),
                                                                   *part_shapes[0][1:])
