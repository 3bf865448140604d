"""Which experts a token goes to, and with what weight: the HF routers' arithmetic.

Mixtral, Qwen2-MoE and Qwen3-MoE all route the same way: router logits in
the activation dtype, softmax in float32, top-k of the probabilities, and
optionally the k weights divided by their sum (Mixtral always; the Qwen
models when `norm_topk_prob`). They differ in one detail that shows in bf16:
the Qwen routers cast the k weights back to the activation dtype, Mixtral
keeps them in float32. Reproducing that exactly is what lets greedy output
match transformers.

gpt-oss routes the other way round (`route_topk_logits`): top-k of the (biased) logits,
then a softmax over those k alone, in the logits' dtype.
"""

from __future__ import annotations

import torch


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          weights_in_activation_dtype: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (weights [T, k], expert ids [T, k] int64), best expert first."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if weights_in_activation_dtype:
        weights = weights.to(router_logits.dtype)
    return weights, ids


def route_topk_logits(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (weights [T, k] summing to 1, expert ids [T, k] int64), best expert first."""
    top, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(top, dim=-1), ids
