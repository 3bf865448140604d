"""Token sampling on the last pipeline stage, on the logits' device, for the whole batch at once.

Every TP rank of the last stage holds identical full logits, and a request's
random draw is a function of its seed and output position only (see
sample_draw), so every rank that samples gets the same tokens, and a request's
tokens do not depend on which other requests share its batch or which replica
it landed in. Only the sampled ids (and the logprobs a request asked for, and a
per-row flag or two) are copied to the host. Greedy rows are the argmax of the
(processed) logits, bit for bit what they were when sampling ran on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spmd_engine.sample import draw as sample_draw
from spmd_engine.sample.penalties import apply_penalties, mask_stop_ids
from spmd_engine.sampling_params import SamplingParams


@dataclass
class RequestState:
    """What the sampler keeps about one request between steps."""

    params: SamplingParams
    seed: int
    stop_ids: list[int] = field(default_factory=list)  # masked while under min_tokens
    prompt_token_ids: list[int] | None = None  # kept for repetition_penalty / prompt_logprobs
    output_token_ids: list[int] = field(default_factory=list)  # kept for the penalties
    num_sampled: int = 0  # draws so far (the output position when sample() is not told it)
    prompt_logprobs_done: int = 0  # prompt tokens whose logprobs went out (recompute skips them)


class Sampler:
    def __init__(self) -> None:
        self.requests: dict[str, RequestState] = {}

    def add_request(self, request_id: str, params: SamplingParams, seed: int,
                    stop_ids: list[int] | None = None, prompt_token_ids: list[int] | None = None) -> None:
        self.requests[request_id] = RequestState(params, seed, list(stop_ids or []), prompt_token_ids)

    def remove_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def observe(self, request_id: str, output_start: int, token_ids: list[int]) -> None:
        """Tokens scheduled as inputs, the first at output index `output_start` (negative while in
        the prompt): the penalties' history of a request, as the scheduler knows it."""
        state = self.requests.get(request_id)
        if state is None or not state.params.penalized or output_start + len(token_ids) <= 0:
            return
        skip = max(0, -output_start)
        del state.output_token_ids[output_start + skip:]
        state.output_token_ids.extend(token_ids[skip:])

    def sample(self, request_ids: list[str], logits: torch.Tensor, output_index: list[int] | None = None):
        """Return (token ids, per-row logprob maps or None) for logits [B, vocab].

        `output_index`: the output position each row samples (the engine passes it from the
        schedule, and feeds the history through `observe`); without it, each call is the next
        position and the sampled tokens are the history (standalone use)."""
        states = [self.requests[r] for r in request_ids]
        standalone = output_index is None
        if standalone:
            output_index = [s.num_sampled for s in states]
        raw = logits.float()
        x = self._processed(raw, states, output_index)
        greedy = [i for i, s in enumerate(states) if s.params.greedy]
        if len(greedy) == len(states):
            tokens = x.argmax(dim=-1)
        else:
            tokens = torch.empty(len(states), dtype=torch.long, device=x.device)
            if greedy:
                tokens[_index(greedy, x.device)] = sample_draw.select_rows(x, greedy).argmax(dim=-1)
            rows = [i for i, s in enumerate(states) if not s.params.greedy]
            chosen = [states[i] for i in rows]
            ps = [s.params for s in chosen]
            u = sample_draw.uniforms([s.seed for s in chosen], [output_index[i] for i in rows])
            tokens[_index(rows, x.device)] = sample_draw.draw(
                sample_draw.select_rows(x, rows), [p.temperature for p in ps], [max(p.top_k, 0) for p in ps],
                [p.top_p for p in ps], [p.min_p for p in ps], u)
        token_list = tokens.tolist()
        for state, token in zip(states, token_list):
            state.num_sampled += 1
            if standalone and state.params.penalized:
                state.output_token_ids.append(token)
        logprobs = None
        wanted = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        if wanted:
            logprobs = [None] * len(states)
            entries = logprob_entries(sample_draw.select_rows(raw, wanted), tokens[_index(wanted, raw.device)],
                                      [states[i].params.logprobs for i in wanted])
            for i, entry in zip(wanted, entries):
                logprobs[i] = entry
        return token_list, logprobs

    def _processed(self, raw: torch.Tensor, states: list[RequestState], output_index: list[int]) -> torch.Tensor:
        """min_tokens masks, then penalties, on a copy when any row has them (vLLM's order)."""
        under_min = [i for i, s in enumerate(states)
                     if s.stop_ids and output_index[i] < s.params.min_tokens]
        penalized = [i for i, s in enumerate(states) if s.params.penalized]
        if not under_min and not penalized:
            return raw
        x = raw.clone()
        if under_min:
            mask_stop_ids(x, under_min, [states[i].stop_ids for i in under_min])
        if penalized:
            apply_penalties(x, penalized, [states[i] for i in penalized])
        return x


def logprob_entries(logits: torch.Tensor, tokens: torch.Tensor, counts: list[int]):
    """Per row {token id: (logprob, rank)}: the row's top `count` tokens of the model's own
    distribution (log_softmax of the raw logits) plus the given token, rank 1 the most likely."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    ranks = (logp > chosen.unsqueeze(1)).sum(dim=1) + 1
    kmax = min(max(counts), logp.shape[-1])
    top_vals, top_ids = (logp.topk(kmax, dim=-1) if kmax else (logp[:, :0], logp[:, :0].long()))
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    out = []
    for row, (token, value, rank, k) in enumerate(zip(tokens.tolist(), chosen.tolist(), ranks.tolist(), counts)):
        entry = {i: (v, r) for r, (i, v) in enumerate(zip(top_ids[row][:k], top_vals[row][:k]), start=1)}
        if token not in entry:
            entry[token] = (value, rank)
        out.append(entry)
    return out


def _index(rows: list[int], device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long).to(device)
