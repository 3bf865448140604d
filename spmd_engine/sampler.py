"""Token sampling on the last pipeline stage.

Every TP rank of the last stage holds identical full logits, and each request
draws from its own generator seeded once, so every rank that samples gets the
same tokens, and a request's tokens do not depend on which other requests share
its batch or which replica it landed in.
"""

from __future__ import annotations

import torch

from spmd_engine.sampling_params import SamplingParams


class Sampler:
    def __init__(self) -> None:
        self._params: dict[str, SamplingParams] = {}
        self._generators: dict[str, torch.Generator] = {}

    def add_request(self, request_id: str, params: SamplingParams, seed: int) -> None:
        self._params[request_id] = params
        if not params.greedy:
            self._generators[request_id] = torch.Generator().manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)

    def remove_request(self, request_id: str) -> None:
        self._params.pop(request_id, None)
        self._generators.pop(request_id, None)

    def sample(self, request_ids: list[str], logits: torch.Tensor):
        """Return (token ids, per-row logprob maps or None) for logits [B, vocab] float32."""
        params = [self._params[r] for r in request_ids]
        tokens = logits.argmax(dim=-1)
        for row, (rid, p) in enumerate(zip(request_ids, params)):
            if not p.greedy:
                tokens[row] = self._sample_row(logits[row], p, self._generators[rid])
        token_list = tokens.tolist()
        logprobs = None
        if any(p.logprobs is not None for p in params):
            logprobs = self._logprobs(logits, token_list, params)
        return token_list, logprobs

    @staticmethod
    def _sample_row(row: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
        scores = row / p.temperature
        if p.top_k != -1 and p.top_k < scores.numel():
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            drop = cumulative - sorted_probs >= p.top_p  # keep the smallest prefix reaching top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=generator))

    @staticmethod
    def _logprobs(logits, tokens, params):
        """Top-K logprobs of the model's distribution, plus the sampled token (as vLLM does):
        per row {token id: (logprob, rank)}, rank 1 being the most likely token."""
        logp = torch.log_softmax(logits, dim=-1)
        out = []
        for row, (token, p) in enumerate(zip(tokens, params)):
            if p.logprobs is None:
                out.append(None)
                continue
            entry = {}
            if p.logprobs > 0:
                values, ids = torch.topk(logp[row], min(p.logprobs, logp.shape[-1]))
                entry = {int(i): (float(v), rank) for rank, (i, v) in enumerate(zip(ids, values), start=1)}
            if int(token) not in entry:
                value = logp[row, token]
                entry[int(token)] = (float(value), int((logp[row] > value).sum()) + 1)
            out.append(entry)
        return out
