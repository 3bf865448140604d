"""One in-place update of a model's weights from full HF-named tensors, applied over as many
calls as the tensors arrive in (a trainer's state dict at once, or a weight transfer bucket by
bucket).

Why a session and not one call at a time: the names, shapes and targets are worked out once;
a weight packed for the hand-written kernel (vnni) is written in place through PackedRows,
so nothing is unpacked, allocated or packed again; a oneDNN-packed weight (opaque: it cannot
be written in place) is unpacked once, takes its parts (q, k, v; gate, up) across calls, and is
packed again once, as soon as its last part has arrived (so that work overlaps a transfer's
next bucket) or when the session closes. A caller that says which tensors are coming
(`expected`: a transfer's manifest, every name and shape checked before any byte) spares a
oneDNN weight whose every part is among them the unpacking: a fresh buffer takes the parts.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
from torch import nn

from spmd_engine.kernels.packed_rows import PackedRows
from spmd_engine.kernels.packed_weights import dense_shape, dense_weight, layout, repack


class InPlaceUpdate:
    def __init__(self, model, expected: Iterable[str] | None = None):
        from spmd_engine.model.weights import hf_tensor_shapes
        if model.weights_discarded:  # asleep at level 2: this load brings the weights back
            model.allocate_discarded_weights()
        self.model = model
        self.shapes = hf_tensor_shapes(model.spec)
        self.targets = model._update_targets()
        self.expected = None if expected is None else set(expected)
        self._parts: dict[str, dict[Any, set[str]]] = {}  # parameter -> shard_id -> HF names writing it
        for hf_name, targets in self.targets.items():
            for param_name, shard_id in targets:
                self._parts.setdefault(param_name, {}).setdefault(shard_id, set()).add(hf_name)
        self._staged: dict[nn.Module, tuple[torch.Tensor, set]] = {}  # oneDNN modules being written
        self._restaged: set[nn.Module] = set()  # packed once already: a later write starts from it

    def __enter__(self) -> "InPlaceUpdate":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def apply(self, weights: Iterable[tuple[str, Any]] | Mapping[str, Any]) -> set[str]:
        """CausalLMWeights.update_weights' contract, for one call of the session."""
        if isinstance(weights, Mapping):
            weights = weights.items()
        from spmd_engine.model.weights import is_skipped_name
        model, loaded = self.model, set()
        try:
            for name, tensor in weights:
                if not isinstance(name, str):
                    raise ValueError(f"load_weights expects (name, tensor) pairs, got a name {name!r}")
                if is_skipped_name(name):
                    continue
                if name not in self.shapes:
                    raise ValueError(f"load_weights: unknown weight name {name!r} (not a tensor of this "
                                     f"{model.spec.architecture} model)")
                if hasattr(tensor, "full_tensor"):
                    tensor = tensor.full_tensor()
                if not isinstance(tensor, torch.Tensor):
                    raise ValueError(f"load_weights: {name} is a {type(tensor).__name__}, not a tensor")
                if tuple(tensor.shape) != self.shapes[name]:
                    raise ValueError(f"load_weights: {name} has shape {list(tensor.shape)}, "
                                     f"expected {list(self.shapes[name])}")
                for param_name, shard_id in self.targets.get(name, ()):
                    module_name, _, attr = param_name.rpartition(".")
                    module = model.get_submodule(module_name)
                    with torch.no_grad():
                        module.weight_loader(self._writable(module, attr, param_name), tensor.detach(), shard_id)
                    self._written(module, shard_id)
                    loaded.add(name)
                    model._mark_written(name)
        except Exception as exc:
            model.note_update_error(f"{type(exc).__name__}: {exc}")
            raise
        return loaded

    def _writable(self, module: nn.Module, attr: str, param_name: str):
        """What the module's weight_loader writes into: the parameter itself, its packed rows,
        or the dense buffer of a oneDNN weight until it is packed again."""
        param = getattr(module, attr)
        kind = layout(param)
        if kind == "dense":
            return param
        if kind == "vnni":
            return PackedRows(param)
        staged = self._staged.get(module)
        if staged is None:
            parts = self._parts[param_name]
            fresh = (self.expected is not None and module not in self._restaged
                     and all(names & self.expected for names in parts.values()))
            dense = torch.empty(dense_shape(param), dtype=param.dtype) if fresh else dense_weight(param)
            staged = self._staged[module] = (dense, set(parts))
        return staged[0]

    def _written(self, module: nn.Module, shard_id) -> None:
        staged = self._staged.get(module)
        if staged is not None:
            staged[1].discard(shard_id)
            if not staged[1]:
                self._pack(module)

    def _pack(self, module: nn.Module) -> None:
        dense, _ = self._staged.pop(module)
        repack(module, dense)
        self._restaged.add(module)

    def close(self) -> None:
        """Pack what is still staged (weights some of whose parts never came)."""
        for module in list(self._staged):
            self._pack(module)
