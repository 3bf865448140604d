"""LongRoPE (Phi-3's `longrope` rope scaling), with the switch where transformers makes it.

Two sets of per-frequency divisors: `short_factor` for sequences that fit the pretraining
context (`original_max_position_embeddings`), `long_factor` beyond it, and one attention
factor that scales cos and sin alike. transformers' Phi-3 picks the set for each forward from
that forward's sequence length, and its `generate` recomputes the whole cache when a sequence
first grows past the original context, so a request's keys are always all of one set: the
short one while it holds at most `original` tokens, the long one from then on.

Here the same holds. A request's set follows its length before the step (prompt plus the
tokens sampled so far, `AttentionMetadata.known_lens`, kept by the runner), or the step's own
end where that is longer: the same for a whole prompt, its chunks, or its recompute after
preemption. `LongRopeSwitch` (the scheduler's `stale_cache` hook) sends a request back to be
recomputed when its sampled token takes it past the original context, and moves its
prefix-cache hashes to a root of their own, as `prefix_cache_root` does for prompts that
start past it: short-set and long-set blocks of the same tokens never meet. Without
`known_lens` (a hand-built step, a trainer's forward) a row counts as a whole sequence, as
transformers' forward does.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Mapping

import torch

from spmd_engine.model.layers.rotary import RotaryEmbedding


def longrope_scaling(scaling: Mapping[str, Any], rotary_dim: int, max_position_embeddings: int,
                     original: int | None) -> dict[str, Any]:
    """The config's longrope dict completed as transformers completes it: the original context
    (`original`, from the config's top level, wins over the dict's), and the attention factor
    (given, or sqrt(1 + ln(factor) / ln(original)) with factor = max / original by default).
    A ValueError names a factor list of the wrong length."""
    original = int(original or scaling.get("original_max_position_embeddings") or max_position_embeddings)
    for key in ("short_factor", "long_factor"):
        factors = scaling.get(key)
        if not isinstance(factors, list) or len(factors) != rotary_dim // 2 \
                or not all(isinstance(f, (int, float)) and not isinstance(f, bool) for f in factors):
            raise ValueError(f"rope_scaling {key} must be a list of {rotary_dim // 2} numbers (rotary_dim / 2)")
    factor = scaling.get("factor") or max_position_embeddings / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {**scaling, "rope_type": "longrope", "original_max_position_embeddings": original,
            "attention_factor": float(attention)}


def prefix_cache_root(root: bytes | None, scaling: Mapping[str, Any] | None, num_prompt_tokens: int) -> bytes | None:
    """What a request's prefix-cache hashes chain from: `root` (its adapter's, None for the base
    model), moved aside for a prompt longer than the original context, whose keys turn with the
    long factors and so must never meet a short prompt's blocks of the same tokens."""
    if not scaling or scaling.get("rope_type") != "longrope" \
            or num_prompt_tokens <= scaling["original_max_position_embeddings"]:
        return root
    return hashlib.sha256((root or b"") + b"longrope:long").digest()


class LongRopeSwitch:
    """The scheduler's `stale_cache` hook: True, once, when a request whose prompt fit the
    original context has just grown past it (its cached keys turned with the short set)."""

    def __init__(self, scaling: Mapping[str, Any]):
        self.scaling = scaling
        self.original = int(scaling["original_max_position_embeddings"])

    def __call__(self, request) -> bool:
        if request.num_tokens != self.original + 1 or request.num_prompt_tokens > self.original:
            return False
        request.cache_root = prefix_cache_root(request.cache_root, self.scaling, request.num_tokens)
        request.block_hashes.clear()  # chained from the old root
        return True


class LongRopeEmbedding(RotaryEmbedding):
    def __init__(self, head_dim: int, theta: float, scaling: Mapping[str, Any], rotary_dim: int | None = None):
        super().__init__(head_dim, theta, None, rotary_dim=rotary_dim)
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim
        powers = theta ** exponents
        self._short = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * powers)
        self._long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * powers)
        self.original = int(scaling["original_max_position_embeddings"])
        self.attention_factor = float(scaling["attention_factor"])

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, attn=None) -> tuple[torch.Tensor, torch.Tensor]:
        p = positions.float().unsqueeze(-1)
        device = positions.device
        long = (_sequence_lengths(positions, attn) > self.original).unsqueeze(-1)
        angles = torch.where(long, p * self._frequencies(self._long, device), p * self._frequencies(self._short, device))
        return self._cos_sin(angles, dtype, self.attention_factor)


def _sequence_lengths(positions: torch.Tensor, attn) -> torch.Tensor:
    """Per token, the length transformers would compare with the original context: its
    request's known length, or p + 1 where longer. A row whose known length is not given
    counts as a sequence ending at its last token; a decode-graph step (a tuple) holds
    decodes only: p + 1."""
    if attn is None:  # [B, T] rows (or [T]) without a cache: each row one whole forward
        return (positions.amax(dim=-1, keepdim=True) + 1).expand_as(positions)
    if isinstance(attn, tuple):
        return positions + 1
    rows = attn.row_order
    lens = [attn.query_lens[r] for r in rows]
    known = getattr(attn, "known_lens", None)
    if known is not None:
        floor = torch.tensor([known[r] for r in rows], device=positions.device)
    else:  # each row's own end
        floor = positions[torch.tensor([attn.row_start[r] + lens[i] - 1 for i, r in enumerate(rows)],
                                       device=positions.device)] + 1
    per_token = torch.repeat_interleave(floor, torch.tensor(lens, device=positions.device))
    return torch.maximum(per_token, positions + 1)
