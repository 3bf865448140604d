"""Structured outputs in the sampler: the grammar's packed bitmask applied to the logits.

The engine computes which ids each constrained request may sample (a grammar
backend fills one row of 32-bit words per request) and ships the rows with the
step; here they become -inf on every other id, before any other processing
(vLLM's order), so temperature, penalties, top-k / top-p / min-p and the seeded
draw all see only ids the grammar allows, and "processed_*" logprobs see the
mask while "raw_*" ones (taken before it) do not.
"""

from __future__ import annotations

import numpy as np
import torch


def unpack(bitmask: np.ndarray, vocab: int, device) -> torch.Tensor:
    """bool [rows, vocab]: id 32 * i + j allowed where bit j of word i is set; ids beyond the
    mask's width (a padded vocabulary) are not allowed."""
    words = torch.from_numpy(np.ascontiguousarray(bitmask, dtype=np.int32)).to(device)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = ((words.unsqueeze(-1) >> shifts) & 1).bool().reshape(words.shape[0], -1)
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    out = torch.zeros(words.shape[0], vocab, dtype=torch.bool, device=device)
    out[:, :bits.shape[1]] = bits
    return out


def apply(x: torch.Tensor, rows: list[int], allowed: torch.Tensor) -> None:
    """In place: x[rows[k], id] = -inf wherever allowed[k, id] is False."""
    index = torch.tensor(rows, dtype=torch.long).to(x.device)
    x[index] = x.index_select(0, index).masked_fill(~allowed, float("-inf"))


def only_stop_ids(allowed: torch.Tensor, stop_ids: list[int]) -> bool:
    """Whether the grammar allows nothing but stop ids (it can only end): then min_tokens
    must not mask them, or the row would have no id left."""
    rest = allowed.clone()
    ids = [i for i in stop_ids if 0 <= i < rest.shape[0]]
    if ids:
        rest[torch.tensor(ids, dtype=torch.long, device=rest.device)] = False
    return not bool(rest.any())
