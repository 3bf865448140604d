"""Logit processing before the draw, batched over the rows that ask for it (vLLM's meanings).

- min_tokens: EOS and stop_token_ids get -inf until the request has sampled
  min_tokens tokens, so neither can end it early.
- repetition_penalty r over the prompt's and the output's tokens: a positive
  logit is divided by r, a negative one multiplied (r > 1 discourages repeats);
- frequency_penalty f and presence_penalty p over the output's tokens only:
  logit -= f * count + p * (count > 0).
Counts are built on the logits' device from the token lists each step (one
scatter per penalised batch), so nothing per row is looped over in torch.
"""

from __future__ import annotations

import torch


def mask_stop_ids(x: torch.Tensor, rows: list[int], ids: list[list[int]]) -> None:
    c = [i for row_ids in ids for i in row_ids if 0 <= i < x.shape[1]]
    r = [row for row, row_ids in zip(rows, ids) for i in row_ids if 0 <= i < x.shape[1]]
    if c:
        x[torch.tensor(r).to(x.device), torch.tensor(c).to(x.device)] = float("-inf")


def apply_penalties(x: torch.Tensor, rows: list[int], states) -> None:
    """In place on rows of x, with states[i].params / .output_token_ids / .prompt_token_ids."""
    device, vocab = x.device, x.shape[1]
    index = torch.tensor(rows, dtype=torch.long).to(device)
    sub = x.index_select(0, index)
    params = [s.params for s in states]
    counts = _counts([s.output_token_ids for s in states], vocab, device)
    rep = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in rep):
        seen = counts > 0
        prompts = [s.prompt_token_ids or [] for s in states]
        if any(prompts):
            seen |= _counts(prompts, vocab, device) > 0
        r = torch.tensor(rep, dtype=sub.dtype).to(device).unsqueeze(1)
        sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=sub.dtype).to(device).unsqueeze(1)
    pres = torch.tensor([p.presence_penalty for p in params], dtype=sub.dtype).to(device).unsqueeze(1)
    sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
    x[index] = sub


def _counts(lists: list[list[int]], vocab: int, device) -> torch.Tensor:
    """[rows, vocab] float counts of each id in each list (ids outside the vocabulary dropped)."""
    width = max((len(ids) for ids in lists), default=0)
    padded = torch.full((len(lists), width + 1), vocab, dtype=torch.long)
    for row, ids in enumerate(lists):
        if ids:
            padded[row, : len(ids)] = torch.tensor(ids, dtype=torch.long).clamp(0, vocab)
    padded = padded.to(device)
    counts = torch.zeros(len(lists), vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab]
