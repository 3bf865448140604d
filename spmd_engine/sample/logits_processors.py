"""The per-request logit processors that run before the penalties (vLLM's order and meanings).

allowed_token_ids, then bad_words, then the min_tokens mask (penalties.py), then
logit_bias. Each works on the rows that ask for it only, with one indexed write
per batch, so a batch without them pays nothing.
"""

from __future__ import annotations

import torch


def mask_outside_allowed(x: torch.Tensor, rows: list[int], allowed: list[list[int]]) -> None:
    """Every id not in the row's allowed list gets -inf."""
    keep = torch.zeros(len(rows), x.shape[1], dtype=torch.bool)
    for i, ids in enumerate(allowed):
        keep[i, torch.tensor([t for t in ids if t < x.shape[1]], dtype=torch.long)] = True
    index = torch.tensor(rows, dtype=torch.long).to(x.device)
    x[index] = x.index_select(0, index).masked_fill(~keep.to(x.device), float("-inf"))


def banned_by_bad_words(words: list[list[int]], output: list[int]) -> list[int]:
    """The ids a request may not sample next: each word's last token, when the output so far
    ends with the word's earlier tokens (a one-token word is always banned)."""
    banned = []
    for word in words:
        head = word[:-1]
        if not head or (len(output) >= len(head) and output[len(output) - len(head):] == head):
            banned.append(word[-1])
    return banned


def add_bias(x: torch.Tensor, rows: list[int], biases: list[dict[int, float]]) -> None:
    r = [row for row, bias in zip(rows, biases) for t in bias if t < x.shape[1]]
    c = [t for bias in biases for t in bias if t < x.shape[1]]
    v = [b for bias in biases for t, b in bias.items() if t < x.shape[1]]
    if c:
        ri, ci = torch.tensor(r).to(x.device), torch.tensor(c).to(x.device)
        x[ri, ci] += torch.tensor(v, dtype=x.dtype).to(x.device)

