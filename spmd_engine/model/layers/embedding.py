"""Vocabulary-parallel embedding and LM head.

The vocabulary is padded (to a multiple of 64, and of the TP size so every rank
gets the same number of rows) and split into contiguous row ranges. The padding
rows are zero and never leave this file: logits are cut back to the real
vocabulary before anyone sees them.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from spmd_engine.kernels import vnni_gemm
from spmd_engine.kernels.packed_weights import layout, linear
from spmd_engine.model.layers import batch_invariant as bi
from spmd_engine.model.shard import Loaded, check_shape, copy_into, read_range

VOCAB_PADDING = 64


def padded_vocab_size(vocab_size: int, tp_size: int, pad_to: int = VOCAB_PADDING) -> int:
    multiple = pad_to * tp_size // math.gcd(pad_to, tp_size)
    return -(-vocab_size // multiple) * multiple


class VocabParallelEmbedding(nn.Module):
    """Each rank holds rows [vocab_start, vocab_end) of the (padded) table.

    A token id outside this rank's range looks up row 0 and is then zeroed, so
    the all-reduce (a sum in which exactly one rank contributes) yields the
    exact embedding on every rank.
    """

    def __init__(self, vocab_size: int, hidden_size: int, group, dtype: torch.dtype | None = None):
        super().__init__()
        self.group = group
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.padded_vocab_size = padded_vocab_size(vocab_size, group.world_size)
        self.rows_per_rank = self.padded_vocab_size // group.world_size
        self.vocab_start = group.rank_in_group * self.rows_per_rank
        self.vocab_end = self.vocab_start + self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size, dtype=dtype),
                                   requires_grad=False)

    def extra_repr(self) -> str:
        return (f"vocab={self.vocab_size} (padded {self.padded_vocab_size}), "
                f"rows [{self.vocab_start}, {self.vocab_end}), hidden={self.hidden_size}")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group.world_size == 1:  # every id is in range (input_processor checks): no mask, no sum
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce(out)

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id=None) -> None:
        check_shape(loaded, (self.vocab_size, self.hidden_size), type(self).__name__)
        real_rows = max(0, min(self.vocab_end, self.vocab_size) - self.vocab_start)
        param.data[real_rows:].zero_()
        if real_rows:
            shard = read_range(loaded, 0, self.vocab_start, self.vocab_start + real_rows)
            copy_into(param.data[:real_rows], shard)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, sharded like the embedding (so tied weights line up).

    `compute_logits` all-gathers the vocabulary slices, so every rank of the TP
    group ends with the same full logits (sampling may then run anywhere). With `softcap`
    (Gemma's final_logit_softcapping) they are squashed to softcap * tanh(logits / softcap).
    """

    packable_weight = True  # see packed_weights.py
    batch_invariant = False
    softcap: float | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # pragma: no cover - guard
        raise RuntimeError("ParallelLMHead is used through compute_logits(hidden)")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = (bi.linear if self.batch_invariant else linear)(hidden, self.weight)
        full = self.group.all_gather(local, dim=-1)
        logits = full[..., : self.vocab_size].float()
        if self.softcap is None:
            return logits
        tanh = functools.partial(bi.pointwise, torch.tanh) if self.batch_invariant else torch.tanh
        return tanh(logits / self.softcap) * self.softcap

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N] int64: each row's argmax of compute_logits(hidden), the same tokens. With one
        rank's vocabulary in the hand-written GEMM's layout (bf16 or fp32), the kernel scans the logits as it writes
        them (vnni_gemm.linear_argmax): no float copy, no second pass."""
        # Not with a softcap: tanh can round two logits to one value, and the argmax must then
        # be the capped logits' (the first of the tie), not the raw ones'.
        if (self.group.world_size == 1 and not self.batch_invariant and self.softcap is None
                and layout(self.weight) == "vnni"):
            return vnni_gemm.linear_argmax(hidden, self.weight, self.vocab_size)
        from spmd_engine.model.layers.greedy import greedy_tokens
        return greedy_tokens(self.compute_logits(hidden))
