"""DeepSeek's router: experts chosen within the best groups of experts, the HF arithmetic.

The experts are cut into `num_groups` equal groups; each token first keeps its `topk_groups`
best groups, then its top-k experts among theirs. V3 scores with a sigmoid, adds a learned
per-expert `e_score_correction_bias` for the choice only (the weights are the uncorrected
scores), rates a group by the sum of its two best experts and hides the other groups at -inf;
V2 scores with a softmax and rates a group by its best expert, hiding the others at 0 (its
"greedy" method is one group). Then the k weights are optionally divided by their sum (V3's
`norm_topk_prob`) and multiplied by `routed_scaling_factor`. Everything is float32, as HF's
router is kept in float32 whatever the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spmd_engine.model.layers import batch_invariant as bi


@dataclass(frozen=True)
class GroupedTopK:
    scoring: str  # "sigmoid" (V3) or "softmax" (V2)
    num_groups: int
    topk_groups: int
    group_score: str  # "top2_sum" (V3) or "max" (V2)
    masked_score: float  # what a hidden group's experts score: -inf (V3) or 0.0 (V2)
    correction_bias: bool  # V3: a per-expert bias added to the scores for the choice
    renormalize: bool
    scaling_factor: float


def grouped_route(router_logits: torch.Tensor, top_k: int, g: GroupedTopK, bias: torch.Tensor | None = None,
                  invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] float32 logits -> (weights [T, k] float32, expert ids [T, k] int64), best first
    by the (corrected) score the choice was made on. `invariant`: the sigmoid through
    batch_invariant.pointwise (torch's elementwise kernel gives a tensor's tail other bits)."""
    logits = router_logits.float()
    if g.scoring == "sigmoid":
        scores = bi.pointwise(torch.sigmoid, logits) if invariant else logits.sigmoid()
    else:
        scores = logits.softmax(dim=-1)
    choice = scores + bias.float() if g.correction_bias and bias is not None else scores
    if g.num_groups > 1:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, g.num_groups, experts // g.num_groups)
        rating = grouped.topk(2, dim=-1).values.sum(-1) if g.group_score == "top2_sum" else grouped.amax(-1)
        kept = torch.zeros_like(rating, dtype=torch.bool)
        kept.scatter_(1, rating.topk(g.topk_groups, dim=-1).indices, True)
        hidden = ~kept.repeat_interleave(experts // g.num_groups, dim=1)
        choice = choice.masked_fill(hidden, g.masked_score)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if g.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * g.scaling_factor, ids
