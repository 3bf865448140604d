"""A chunk of decoder layers as a function of tensors only, the form AOTInductor builds.

torch.export lifts a module's parameters and plain tensor attributes into the package as
constants: the weights would be copied into every package (and a weight update would not reach
it), and the KV caches, written in place every step, would be frozen copies. So the exported
module owns nothing: its inputs are the chunk's weights, in a fixed order, then each layer's
(K, V) caches, then the step's tensors; `forward` puts them in place for the trace
(torch.func.functional_call for the weights, the attention modules' cache attributes for the
caches) and takes them out again afterwards. On the last pipeline stage the model's final norm
comes last among the weights, and the chunk returns the normed sum as well (compiled_layers.py).

Nothing here may hold a container whose identity matters later: torch.export snapshots the
exported module's plain attributes through pytree and puts the snapshot back when it is done
(`_detect_attribute_assignment`), which rebuilds every list, tuple and dict in them. So the
weights are found through their modules (which pytree leaves alone), never through a kept
`_parameters` dict: a kept one came back from the export as a copy, and a weight replaced
afterwards (a repack after `load_weights`, sleep level 2) never reached the graph.
"""

from __future__ import annotations

import torch
from torch import nn

from spmd_engine.forward_context import COMPILED


def _attention(layer) -> nn.Module:
    """The layer's attention: the module that holds its KV cache."""
    return next(m for m in layer.modules() if hasattr(m, "k_cache") and hasattr(m, "v_cache"))


def windows(chunk: tuple) -> tuple:
    """The chunk's layers' sliding windows (None: full attention): part of what decides its graph,
    each layer's window being a constant in it."""
    return tuple(getattr(_attention(layer), "sliding_window", None) for layer in chunk)


class ChunkProgram(nn.Module):
    """`forward(weights, caches, cos, sin, hidden, residual, decode)` runs the chunk's layers as
    compiled_layers' `_chunk_step` does (with `norm`, the final RMSNorm, applied to the result as
    well). `flat_inputs` gives the live tensors in export's order."""

    def __init__(self, chunk: tuple, norm: nn.Module | None = None):
        super().__init__()
        object.__setattr__(self, "chunk", tuple(chunk))  # not submodules: their weights are inputs
        object.__setattr__(self, "norm", norm)
        self.names = [[name for name, _ in layer.named_parameters()] for layer in chunk]
        self._owners = [_owner(layer, name) for layer, names in zip(chunk, self.names) for name in names]
        if norm is not None:
            self._owners.append((norm, "weight"))
        self._attention = [_attention(layer) for layer in chunk]
        self.leading = len(self._owners) + 2 * len(chunk)  # weights and caches

    def weights(self) -> list[torch.Tensor]:
        # Read from each module's parameter dict, not through nn.Module.__getattr__ (a few us a
        # step for a chunk's ~60 weights): a name registered as a parameter stays one, since
        # nn.Module refuses to rebind it to anything but a Parameter. The dict is looked up on
        # the module every time (the module docstring says why).
        return [module._parameters[name] for module, name in self._owners]

    def caches(self) -> list[torch.Tensor]:
        return [c for a in self._attention for c in (a.k_cache, a.v_cache)]

    def cache_windows(self) -> list[int | None]:
        """The sliding window of each of `caches()`' layers (None: full attention)."""
        return [getattr(a, "sliding_window", None) for a in self._attention for _ in (a.k_cache, a.v_cache)]

    def packed(self) -> list[bool]:
        """Which weights are packed (oneDNN): they reach the graph only through spmd_engine::linear."""
        return [w.is_mkldnn for w in self.weights()]

    def flat_inputs(self, cos, sin, hidden, residual, decode) -> list[torch.Tensor]:
        return [*self.weights(), *self.caches(), cos, sin, hidden, residual, *(decode or ())]

    def forward(self, weights, caches, cos, sin, hidden, residual, decode):
        attn = COMPILED if decode is None else decode
        bound = [(a.k_cache, a.v_cache) for a in self._attention]
        at = 0
        try:
            for i, layer in enumerate(self.chunk):
                self._attention[i].k_cache, self._attention[i].v_cache = caches[2 * i], caches[2 * i + 1]
                params = dict(zip(self.names[i], weights[at:at + len(self.names[i])]))
                at += len(self.names[i])
                hidden, residual = torch.func.functional_call(layer, params, ((cos, sin), hidden, residual, attn))
        finally:
            for a, (k, v) in zip(self._attention, bound):
                a.k_cache, a.v_cache = k, v
        if self.norm is None:
            return hidden, residual
        normed, _ = torch.func.functional_call(self.norm, {"weight": weights[-1]}, (hidden, residual))
        return hidden, residual, normed


def _owner(layer: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module whose parameter `name` (dotted, under `layer`) is, and its name there."""
    *path, attr = name.split(".")
    module = layer
    for part in path:
        module = getattr(module, part)
    return module, attr
