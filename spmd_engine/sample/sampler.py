"""Token sampling on the last pipeline stage, on the logits' device, for the whole batch at once.

Every TP rank of the last stage holds identical full logits, and a request's
random draw is a function of its seed and output position only (see
sample_draw), so every rank that samples gets the same tokens, and a request's
tokens do not depend on which other requests share its batch or which replica
it landed in. Only the sampled ids (and the logprobs a request asked for, and a
per-row flag or two) are copied to the host. Greedy rows are the argmax of the
(processed) logits, bit for bit what they were when sampling ran on the host.

What the logprobs are is the engine's `logprobs_mode` (vLLM's four): "raw_logprobs"
(log_softmax of the model's logits, the default) and "raw_logits" come before any
processing; "processed_logprobs" and "processed_logits" after the logit
processors and penalties and, for a sampled row, after temperature with every
token that min_p / top_k / top_p drop at -inf, i.e. the distribution the token
was drawn from. A greedy row's processed values skip temperature and the
filters (its choice does not depend on them), as vLLM's greedy path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spmd_engine.config import LOGPROBS_MODES
from spmd_engine.model.layers import batch_invariant as bi
from spmd_engine.model.layers.greedy import greedy_tokens
from spmd_engine.sample import draw as sample_draw
from spmd_engine.sample import grammar_mask
from spmd_engine.sample import logits_processors as procs
from spmd_engine.sample.penalties import apply_penalties, mask_stop_ids
from spmd_engine.sampling_params import SamplingParams


@dataclass
class RequestState:
    """What the sampler keeps about one request between steps."""

    params: SamplingParams
    seed: int
    stop_ids: list[int] = field(default_factory=list)  # masked while under min_tokens
    prompt_token_ids: list[int] | None = None  # kept for repetition_penalty / prompt_logprobs
    output_token_ids: list[int] = field(default_factory=list)  # kept for the penalties and bad words
    num_sampled: int = 0  # draws so far (the output position when sample() is not told it)
    prompt_logprobs_done: int = 0  # prompt tokens whose logprobs went out (recompute skips them)
    plain: bool = False  # greedy and nothing else (no processing, logprobs or mask): sample's short path

    def __post_init__(self) -> None:
        p = self.params
        self.plain = (p.greedy and p.logprobs is None and not p.return_sampling_mask and p.allowed_token_ids is None
                      and not p.bad_words and not p.logit_bias and not p.penalized
                      and not (self.stop_ids and p.min_tokens > 0) and p.structured_outputs is None)


@dataclass
class SamplerOutput:
    """Per sampled row: its token, its logprob entries (None unless asked) and its sampling
    mask (the ids it could have drawn, sorted, when asked)."""

    token_ids: list[int]
    logprobs: list[dict[int, tuple[float, int]] | None] | None = None
    sampling_masks: list | None = None  # numpy int32 arrays or None


class Sampler:
    def __init__(self, logprobs_mode: str = "raw_logprobs", batch_invariant: bool = False) -> None:
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode
        self.batch_invariant = batch_invariant  # logprobs through batch_invariant.log_softmax
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
        if state is None or not state.params.keeps_history or output_start + len(token_ids) <= 0:
            return
        skip = max(0, -output_start)
        del state.output_token_ids[output_start + skip:]
        state.output_token_ids.extend(token_ids[skip:])

    def all_plain(self, request_ids: list[str]) -> bool:
        """Whether every one of these rows only wants its argmax (RequestState.plain): then the
        LM head may give the tokens directly and `take_greedy` stands for `sample`."""
        requests = self.requests
        return all(requests[r].plain for r in request_ids)

    def take_greedy(self, request_ids: list[str], tokens: torch.Tensor) -> SamplerOutput:
        """The draw of plain rows whose argmax was taken elsewhere (the LM head's fused argmax):
        counted as sample() counts it, so later positions and seeds line up either way."""
        for r in request_ids:
            self.requests[r].num_sampled += 1
        return SamplerOutput(tokens.tolist())

    def sample(self, request_ids: list[str], logits: torch.Tensor, output_index: list[int] | None = None,
               grammar=None):
        """A SamplerOutput for logits [B, vocab] (the rows of request_ids, in order).

        `output_index`: the output position each row samples (the engine passes it from the
        schedule, and feeds the history through `observe`); without it, each call is the next
        position and the sampled tokens are the history (standalone use). `grammar`: the step's
        GrammarBitmask (structured outputs), applied before any other processing."""
        states = [self.requests[r] for r in request_ids]
        if all(s.plain for s in states):  # each row's argmax, nothing to process or report
            return self.take_greedy(request_ids, greedy_tokens(logits.float()))
        standalone = output_index is None
        if standalone:
            output_index = [s.num_sampled for s in states]
        raw = logits.float()
        x = self._processed(raw, states, output_index, _grammar_rows(grammar, request_ids, raw))
        greedy = [i for i, s in enumerate(states) if s.params.greedy]
        rows = [i for i, s in enumerate(states) if not s.params.greedy]
        if not rows:
            tokens = greedy_tokens(x)
        else:
            tokens = torch.empty(len(states), dtype=torch.long, device=x.device)
            if greedy:
                tokens[_index(greedy, x.device)] = greedy_tokens(sample_draw.select_rows(x, greedy))
            ps = [states[i].params for i in rows]
            u = sample_draw.uniforms([states[i].seed for i in rows], [output_index[i] for i in rows])
            tokens[_index(rows, x.device)] = sample_draw.draw(
                sample_draw.select_rows(x, rows), *_filters(ps), u)
        token_list = tokens.tolist()
        for state, token in zip(states, token_list):
            state.num_sampled += 1
            if standalone and state.params.keeps_history:
                state.output_token_ids.append(token)
        result = SamplerOutput(token_list)
        processed = self.logprobs_mode.startswith("processed")
        wanted = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        masked = [i for i, s in enumerate(states) if s.params.return_sampling_mask
                  or (processed and s.params.logprobs is not None and not s.params.greedy)]
        support = _support(x, states, masked)
        if wanted:
            values = raw if not processed else _processed_values(x, states, wanted, support)
            entries = logprob_entries(sample_draw.select_rows(values, wanted), tokens[_index(wanted, raw.device)],
                                      [states[i].params.logprobs for i in wanted],
                                      normalize=self.logprobs_mode.endswith("logprobs"),
                                      invariant=self.batch_invariant)
            result.logprobs = [None] * len(states)
            for i, entry in zip(wanted, entries):
                result.logprobs[i] = entry
        if any(s.params.return_sampling_mask for s in states):
            result.sampling_masks = [support[i].nonzero().flatten().to(torch.int32).cpu().numpy()
                                     if states[i].params.return_sampling_mask else None for i in range(len(states))]
        return result

    def _processed(self, raw: torch.Tensor, states: list[RequestState], output_index: list[int],
                   grammar: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
        """The grammar's mask, allowed_token_ids, bad_words, min_tokens, logit_bias, then
        penalties, on a copy when any row has one (vLLM's order). min_tokens leaves a row's stop
        ids alone where its grammar allows nothing else (it can only end)."""
        allowed = [i for i, s in enumerate(states) if s.params.allowed_token_ids is not None]
        banned = {i: procs.banned_by_bad_words(s.params.bad_words_token_ids, s.output_token_ids)
                  for i, s in enumerate(states) if s.params.bad_words_token_ids}
        banned = {i: ids for i, ids in banned.items() if ids}
        under_min = [i for i, s in enumerate(states)
                     if s.stop_ids and output_index[i] < s.params.min_tokens]
        if grammar is not None:
            ending = {i for k, i in enumerate(grammar[0]) if i in under_min
                      and grammar_mask.only_stop_ids(grammar[1][k], states[i].stop_ids)}
            under_min = [i for i in under_min if i not in ending]
        biased = [i for i, s in enumerate(states) if s.params.logit_bias]
        penalized = [i for i, s in enumerate(states) if s.params.penalized]
        if not (allowed or banned or under_min or biased or penalized or grammar):
            return raw
        x = raw.clone()
        if grammar is not None:
            grammar_mask.apply(x, *grammar)
        if allowed:
            procs.mask_outside_allowed(x, allowed, [states[i].params.allowed_token_ids for i in allowed])
        if banned:
            mask_stop_ids(x, list(banned), list(banned.values()))
        if under_min:
            mask_stop_ids(x, under_min, [states[i].stop_ids for i in under_min])
        if biased:
            procs.add_bias(x, biased, [states[i].params.logit_bias for i in biased])
        if penalized:
            apply_penalties(x, penalized, [states[i] for i in penalized])
        return x


def _grammar_rows(grammar, request_ids: list[str], raw: torch.Tensor):
    """(batch rows, bool [rows, vocab] allowed ids) of the requests the step's GrammarBitmask
    constrains; None when it constrains none of them."""
    if grammar is None or not grammar.request_ids:
        return None
    where = {rid: k for k, rid in enumerate(grammar.request_ids)}
    pairs = [(i, where[rid]) for i, rid in enumerate(request_ids) if rid in where]
    if not pairs:
        return None
    rows = [i for i, _ in pairs]
    bitmask = grammar.bitmask[[k for _, k in pairs]]
    return rows, grammar_mask.unpack(bitmask, raw.shape[1], raw.device)


def _filters(params: list[SamplingParams]):
    """The draw's per-row settings: temperature, top_k (0 = off), top_p, min_p."""
    return ([p.temperature for p in params], [max(p.top_k, 0) for p in params],
            [p.top_p for p in params], [p.min_p for p in params])


def _support(x: torch.Tensor, states: list[RequestState], rows: list[int]) -> dict[int, torch.Tensor]:
    """Row -> bool [V]: the ids its draw could return; for a greedy row, its argmax (ties too)."""
    out = {}
    drawn = [i for i in rows if not states[i].params.greedy]
    if drawn:
        kept = sample_draw.support(sample_draw.select_rows(x, drawn), *_filters([states[i].params for i in drawn]))
        out.update(zip(drawn, kept))
    for i in rows:
        if states[i].params.greedy:
            out[i] = x[i] == x[i].max()
    return out


def _processed_values(x: torch.Tensor, states: list[RequestState], rows: list[int], support) -> torch.Tensor:
    """The logits each row was drawn from: x / T with the dropped ids at -inf (a greedy row:
    x itself). Only the given rows are meaningful."""
    out = x.clone()
    for i in rows:
        p = states[i].params
        if not p.greedy:
            out[i] = (x[i] / p.temperature).masked_fill(~support[i], float("-inf"))
    return out


def logprob_entries(logits: torch.Tensor, tokens: torch.Tensor, counts: list[int], normalize: bool = True,
                    invariant: bool = False):
    """Per row {token id: (logprob, rank)} built as vLLM builds it, so code that reads the dict
    in order (or by rank) sees what it would see there: the given (sampled or prompt) token
    first, then the row's top `count` (-1: the whole vocabulary), most likely first.

    Ranks are vLLM's: the given token's is how many of the row's values are >= its own (a tie
    ranks it after the tokens it ties with), a top-K entry's is its place in the top K, and a
    given token that is among the top K takes that place (vLLM writes it into the dict twice).
    Ranks and the top K are taken on `logits`, as vLLM's, then valued in log_softmax(logits)
    (or in the logits themselves when not `normalize`). `invariant`: batch_invariant's
    log_softmax, a row's value whatever the other rows."""
    x = logits.float()
    if normalize:
        log_softmax = bi.log_softmax if invariant else (lambda v: torch.log_softmax(v, dim=-1))
        logp = log_softmax(x)
    else:
        logp = x
    vocab = x.shape[-1]
    counts = [vocab if k == -1 else min(k, vocab) for k in counts]
    given = tokens.unsqueeze(1)
    chosen = logp.gather(1, given).squeeze(1).tolist()
    ranks = (x >= x.gather(1, given)).sum(dim=1).tolist()
    kmax = max(counts, default=0)
    top_ids = top_vals = None
    if kmax:
        top = x.topk(kmax, dim=-1).indices
        top_ids, top_vals = top.tolist(), logp.gather(1, top).tolist()
    out = []
    for row, (token, value, rank, k) in enumerate(zip(tokens.tolist(), chosen, ranks, counts)):
        entry = {token: (value, rank)}
        if k:
            entry.update((i, (v, r)) for r, (i, v) in enumerate(zip(top_ids[row][:k], top_vals[row][:k]), start=1))
        out.append(entry)
    return out


def _index(rows: list[int], device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long).to(device)
