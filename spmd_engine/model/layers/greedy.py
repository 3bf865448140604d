"""The argmax of a row of logits, as the model's head and the sampler both take it.

It lives with the model's layers so the LM head (layers/embedding.py) can fuse its argmax
without importing the sampler, a layer above it.
"""

from __future__ import annotations

import torch


def greedy_tokens(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax: the first index of its maximum, or of its first NaN.

    On CPU torch's argmax and max(dim) walk a row element by element; amax is vectorised. So:
    each chunk's amax, the first chunk holding the row's maximum (max(dim) over a few hundred
    values), and the index within it, with the tail beyond the last whole chunk compared last
    (tests/unit/sample/test_sampler.py holds this equal to argmax through ties, NaNs and
    infinities; docs/performance.md the cost)."""
    if not x.is_cpu:
        return x.argmax(dim=-1)
    rows, vocab = x.shape
    whole = vocab // _CHUNK * _CHUNK
    if whole < 2 * _CHUNK or x.stride(-1) != 1:
        return x.max(dim=-1).indices
    head = x[:, :whole].unflatten(1, (whole // _CHUNK, _CHUNK))  # [rows, chunks, _CHUNK], a view
    best, chunk = head.amax(dim=-1).max(dim=-1)  # a NaN is the max of amax and of max alike
    index = chunk * _CHUNK + head[torch.arange(rows), chunk].max(dim=-1).indices
    if whole == vocab:
        return index
    tail, at = x[:, whole:].max(dim=-1)
    later = (tail > best) | (tail.isnan() & ~best.isnan())  # ties go to the earlier index
    return torch.where(later, at + whole, index)


_CHUNK = 128  # greedy_tokens' chunk of a row
