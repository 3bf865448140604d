"""Engine requests -> RequestOutputs, step by step (vLLM's OutputProcessor).

One user request is `n` engine requests (its samples). Each step the engine core
returns the engine requests that made progress; this turns them into at most one
RequestOutput per user request, in the request's `output_kind`: CUMULATIVE (every
token so far), DELTA (the tokens new since its last output) or FINAL_ONLY (one
output when all its samples have finished). Engine request ids are this
processor's own ("<seq>" or "<seq>.<k>", in the order requests were added, the
same on every rank), so a user's id may hold any characters and may be reused
once its request has finished.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from spmd_engine.core.request import Request
from spmd_engine.engine.input_processor import InputProcessor
from spmd_engine.engine.metrics import FrontEndStats
from spmd_engine.engine.outputs import CompletionOutput, Logprob, RequestOutput, RequestStateStats, SamplingMask
from spmd_engine.engine.stop_strings import INCOMPLETE, held_back
from spmd_engine.sampling_params import RequestOutputKind, SamplingParams

SEED_MASK = (1 << 63) - 1


@dataclass
class NewRequest:
    """One user request, tokenized and seeded: what add_request queues and what the ranks of
    a replica exchange under external_launcher. `origin`: (generate call, position) for the
    requests generate adds, None for add_request's."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival_time: float
    origin: tuple[int, int] | None = None
    lora_request: Any = None  # the LoRARequest it runs with (None: the base model)

    @property
    def lora_int_id(self) -> int:
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    def identity(self) -> tuple:
        """What must be equal on every rank (not the arrival time: each rank has its clock)."""
        lora = None if self.lora_request is None else (self.lora_request.lora_name, self.lora_int_id)
        return (self.request_id, self.prompt_token_ids, self.params, self.seed, self.origin, lora)


class _RequestState:
    def __init__(self, new: NewRequest, samples: list[Request]):
        self.new, self.samples = new, samples
        self.sent_tokens = [0] * len(samples)  # DELTA: tokens already returned, per sample
        self.sent_text = [0] * len(samples)
        self.sent_prompt_logprobs = 0  # DELTA: prompt positions already returned
        self.seen_tokens = [0] * len(samples)  # counted into the generation-token metric
        self.emitted_at: int | None = None  # output tokens when the last running output went out

    def due(self) -> bool:
        """SamplingParams.stream_interval (vLLM's): a running request's output goes out for its
        first tokens, then once every `stream_interval` tokens (a DELTA then carries them all)."""
        interval = self.new.params.stream_interval or 1
        tokens = sum(self.seen_tokens)
        if self.emitted_at is not None and tokens - self.emitted_at < interval:
            return False
        self.emitted_at = tokens
        return True

    @property
    def finished(self) -> bool:
        return all(r.finish_reason is not None for r in self.samples)


class OutputProcessor:
    def __init__(self, inputs: InputProcessor, weight_version: Callable[[], Any]):
        self.inputs, self.weight_version = inputs, weight_version
        self.states: dict[str, _RequestState] = {}
        self._by_engine_id: dict[str, tuple[_RequestState, int]] = {}
        self._seq = 0
        self.stats = FrontEndStats()

    def add(self, new: NewRequest) -> list[Request]:
        """The engine requests for a user request (sample k seeded `seed + k`)."""
        if new.request_id in self.states:
            raise ValueError(f"request id {new.request_id!r} is already running")
        base, self._seq = str(self._seq), self._seq + 1
        n = new.params.n
        ids = [base] if n == 1 else [f"{base}.{k}" for k in range(n)]
        samples = [Request(rid, list(new.prompt_token_ids), new.params, (new.seed + k) & SEED_MASK,
                           prompt=new.prompt, arrival_time=new.arrival_time, lora_int_id=new.lora_int_id)
                   for k, rid in enumerate(ids)]
        state = _RequestState(new, samples)
        self.states[new.request_id] = state
        for k, r in enumerate(samples):
            self._by_engine_id[r.request_id] = (state, k)
        return samples

    def engine_ids(self, request_ids) -> list[str]:
        return [r.request_id for rid in request_ids if rid in self.states for r in self.states[rid].samples]

    def drop_unfinished(self) -> None:
        """The engine died: its requests will never finish (the next call reports the death)."""
        self.states.clear()
        self._by_engine_id.clear()

    @property
    def num_unfinished(self) -> int:
        return len(self.states)

    def process(self, progressed: list[Request]) -> list[tuple[tuple[int, int] | None, RequestOutput]]:
        """(origin, output) for each user request these engine requests belong to, in the
        order of their first sample here; finished user requests are forgotten."""
        touched: dict[str, _RequestState] = {}
        for r in progressed:
            found = self._by_engine_id.get(r.request_id)
            if found is None:
                continue  # an abort already reported it
            state, k = found
            state.samples[k] = r  # a DP replica sends a fresh copy each step
            new_tokens = len(r.output_token_ids) - state.seen_tokens[k]
            state.seen_tokens[k] = len(r.output_token_ids)
            self.stats.generation_tokens += new_tokens
            touched.setdefault(state.new.request_id, state)
        outputs = []
        for state in touched.values():
            done = state.finished
            kind = state.new.params.output_kind
            if done:
                self._forget(state)
            if not done and (kind is RequestOutputKind.FINAL_ONLY or not state.due()):
                continue
            outputs.append((state.new.origin, self._output(state, kind, done)))
        return outputs

    def _forget(self, state: _RequestState) -> None:
        del self.states[state.new.request_id]
        for r in state.samples:
            self._by_engine_id.pop(r.request_id, None)
            self.stats.finished[r.finish_reason] = self.stats.finished.get(r.finish_reason, 0) + 1
        self.stats.prompt_tokens += len(state.new.prompt_token_ids)

    def _output(self, state: _RequestState, kind: RequestOutputKind, done: bool) -> RequestOutput:
        samples = state.samples
        completions = []
        for k, r in enumerate(samples):
            full = _completion(k, r, self.inputs)
            if kind is RequestOutputKind.DELTA:
                full = _delta(full, state, k)
            full.lora_request = state.new.lora_request
            completions.append(full)
        first = samples[0]
        prompt_logprobs = None
        if first.params.prompt_logprobs is not None:
            prompt_logprobs = [None] + [_logprob_dict(step, self.inputs, first.params.detokenize)
                                        for step in first.prompt_logprobs or []]
            if kind is RequestOutputKind.DELTA:  # as vLLM: each position once, in the first output that has it
                sent, state.sent_prompt_logprobs = state.sent_prompt_logprobs, len(prompt_logprobs)
                prompt_logprobs = prompt_logprobs[sent:]
        metrics = self._metrics(state, done)
        return RequestOutput(state.new.request_id, first.prompt, list(first.prompt_token_ids), prompt_logprobs,
                             completions, done, metrics, lora_request=state.new.lora_request,
                             num_cached_tokens=metrics.num_cached_tokens, weight_version=self.weight_version())

    def _metrics(self, state: _RequestState, done: bool) -> RequestStateStats:
        samples = state.samples
        stamps = lambda name: [getattr(r, name) for r in samples if getattr(r, name) is not None]  # noqa: E731
        arrival = state.new.arrival_time
        first_token = min(stamps("first_token_time"), default=0.0)
        m = RequestStateStats(
            num_generation_tokens=sum(len(r.output_token_ids) for r in samples),
            num_preemptions=sum(r.num_preemptions for r in samples), arrival_time=arrival, queued_ts=arrival,
            scheduled_ts=min(stamps("first_scheduled_time"), default=0.0), first_token_ts=first_token,
            last_token_ts=max(stamps("last_token_time"), default=0.0),
            first_token_latency=first_token - arrival if first_token else 0.0,
            finished_time=time.time() if done else None, num_prompt_tokens=len(state.new.prompt_token_ids),
            num_cached_tokens=max(0, samples[0].num_cached_tokens))
        if done:
            if first_token:
                self.stats.ttft.observe(m.first_token_latency)
            self.stats.e2e.observe(m.finished_time - m.arrival_time)
        return m


def _delta(full: CompletionOutput, state: _RequestState, k: int) -> CompletionOutput:
    """The part of the sample's completion not returned before (its text is already what may
    be shown: see _completion_text)."""
    start_tok, start_text = state.sent_tokens[k], state.sent_text[k]
    state.sent_tokens[k], state.sent_text[k] = len(full.token_ids), max(start_text, len(full.text))
    full.token_ids = full.token_ids[start_tok:]
    full.text = full.text[start_text:]
    if full.logprobs is not None:
        full.logprobs = full.logprobs[start_tok:]
    if full.sampling_mask is not None:
        mask = full.sampling_mask
        cut = mask.offsets[start_tok]
        full.sampling_mask = SamplingMask(mask.token_ids[cut:], [o - cut for o in mask.offsets[start_tok:]])
    return full


def _logprob_dict(step: dict[int, tuple[float, int]], inputs, detokenize: bool = True) -> dict[int, Logprob]:
    decode = inputs.decode if inputs.tokenizer is not None and detokenize else (lambda ids: None)
    return {token: Logprob(value, rank, decode([token])) for token, (value, rank) in step.items()}


def _completion_text(request: Request, inputs) -> str:
    """The output's text: empty without detokenize; cut at the stop string when one ended it;
    else the tokens decoded, less the EOS or stop token that ended the request (as vLLM).

    A running request shows only text its final output will keep, so that CUMULATIVE texts
    only grow and DELTA texts join into the final one: it holds back a character whose
    first bytes alone have arrived, and an end that could begin a stop string."""
    params = request.params
    if not params.detokenize:
        return ""
    if isinstance(request.stop_reason, str):
        return request.output_text
    ids = request.output_token_ids
    if request.finish_reason == "stop" and not params.include_stop_str_in_output:
        ids = ids[:-1]
    text = inputs.decode(ids, skip_special_tokens=params.skip_special_tokens)
    if request.finish_reason is not None:
        return text
    text = text.rstrip(INCOMPLETE)
    if params.stop and not params.include_stop_str_in_output:
        text = text[:len(text) - held_back(text, params.stop)]
    return text


def _completion(index: int, request: Request, inputs) -> CompletionOutput:
    text = _completion_text(request, inputs)
    logprobs = cumulative = None
    if request.logprobs is not None:
        logprobs = [_logprob_dict(step, inputs, request.params.detokenize) for step in request.logprobs]
        cumulative = sum(step[token].logprob for step, token in zip(logprobs, request.output_token_ids))
    return CompletionOutput(index, text, list(request.output_token_ids), cumulative, logprobs,
                            _routed_experts(request), request.finish_reason, request.stop_reason,
                            sampling_mask=_sampling_mask(request))


def _sampling_mask(request: Request) -> SamplingMask | None:
    if not request.params.return_sampling_mask:
        return None
    masks = request.sampling_masks or []
    offsets = [0]
    for ids in masks:
        offsets.append(offsets[-1] + len(ids))
    return SamplingMask([int(t) for ids in masks for t in ids], offsets)


def _routed_experts(request: Request):
    """Every position the engine computed: the prompt and the generated tokens but the last
    (in a finished request's output only: a running one's rows are still being written)."""
    if request.routed_experts is None or request.finish_reason is None:
        return None
    from spmd_engine.core.routed_experts import join_chunks
    return join_chunks(request.routed_experts, request.num_tokens - 1)
