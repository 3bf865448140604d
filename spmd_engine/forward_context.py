"""Forward-time state: what a layer reads during one forward that is not an argument of its call.

A compiled graph cannot carry a step's AttentionMetadata (Python lists and dataclasses, never
traced: a step's metadata is no guard, so a new batch does not recompile). So a compiled layer
gets the `COMPILED` sentinel in its place, and the opaque attention op reads the step's metadata
from here, set by the compiled forward around each run (compilation/compiled_layers.py). The
compiler and the attention layer both import this module and not each other.
"""

from __future__ import annotations

import contextlib

_attn = None  # this step's AttentionMetadata while a compiled forward runs


class _Compiled:
    """What a compiled layer gets instead of AttentionMetadata: read it from the forward context."""

    def __repr__(self) -> str:
        return "COMPILED"


COMPILED = _Compiled()


@contextlib.contextmanager
def set_forward_context(attn):
    """Make `attn` the metadata the attention op reads, for one forward."""
    global _attn
    previous, _attn = _attn, attn
    try:
        yield
    finally:
        _attn = previous


def attn_metadata():
    """This forward's AttentionMetadata; an error outside set_forward_context."""
    if _attn is None:
        raise RuntimeError("spmd_engine::attention ran outside forward_context.set_forward_context")
    return _attn


_lora_chunk: list = []  # the LoRA layers of the compiled chunk running now, in chunk order


@contextlib.contextmanager
def set_lora_chunk(layers: list):
    """The LoRA layers (model/lora/linear_lora.py) a compiled chunk's `spmd_engine::lora` ops
    refer to by position: a graph serves every chunk of its length, so it names a layer by its
    place in the chunk, and the chunk running now says which layer that is."""
    global _lora_chunk
    previous, _lora_chunk = _lora_chunk, layers
    try:
        yield
    finally:
        _lora_chunk = previous


def lora_chunk() -> list:
    return _lora_chunk
