"""Reading one rank's piece of a checkpoint tensor.

A weight loader receives either a `torch.Tensor` or a safetensors slice handle
(`safe_open(...).get_slice(name)`). Both answer `x[a:b]` and `x[:, a:b]`, but
only the handle reads lazily: indexing it reads just those bytes from the file.
That is what keeps a rank's loading memory close to its own shard, so layers
index the loaded object and never call anything that would read all of it.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

Loaded = Any  # torch.Tensor or safetensors PySafeSlice


def divide(numerator: int, denominator: int, what: str) -> int:
    """Exact division, or a message saying which size does not split."""
    if numerator % denominator:
        raise ValueError(f"{what} {numerator} is not divisible by {denominator}")
    return numerator // denominator


def loaded_shape(loaded: Loaded) -> tuple[int, ...]:
    """Shape of a tensor or of a safetensors slice handle, without reading data."""
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())


def check_shape(loaded: Loaded, expected: Sequence[int], what: str) -> None:
    """A checkpoint tensor of the wrong shape is a broken checkpoint, not a crash."""
    got = loaded_shape(loaded)
    if got != tuple(expected):
        raise ValueError(f"{what}: checkpoint shape {list(got)} != expected {list(expected)}")


def read_range(loaded: Loaded, dim: int, start: int, end: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [start, end) of `loaded`, reading only those."""
    index = (slice(None),) * dim + (slice(start, end),)
    return loaded[index]


def read_all(loaded: Loaded) -> torch.Tensor:
    """The whole tensor: only for replicated parameters (norms, biases after reduce)."""
    return loaded[:] if not isinstance(loaded, torch.Tensor) else loaded


@torch.no_grad()
def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy with the cast to the model dtype (bf16 checkpoints into fp32, etc.)."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"shard shape {list(src.shape)} != parameter shape {list(dst.shape)}")
    dst.copy_(src)


def replicated_weight_loader(param: torch.Tensor, loaded: Loaded, shard_id: Any = None) -> None:
    """Every rank holds the full tensor (norm weights, row-parallel bias)."""
    check_shape(loaded, param.shape, "replicated parameter")
    copy_into(param.data, read_all(loaded))
