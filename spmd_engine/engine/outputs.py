"""What generate() returns, shaped like vLLM's RequestOutput so users' code carries over."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any


@dataclass
class Logprob:
    """One token's log probability, its rank in the distribution (1 = most likely) and its text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class SamplingMask:
    """Per generated token, the ids the sampler could have drawn it from (after min_p, top_k,
    top_p; a greedy token: the argmax), compactly as vLLM's: token t's ids are
    token_ids[offsets[t]:offsets[t + 1]], sorted."""
    token_ids: list[int]
    offsets: list[int]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, t: int) -> list[int]:
        if not -len(self) <= t < len(self):
            raise IndexError(f"sampling mask of {len(self)} tokens has no token {t}")
        t %= len(self)
        return self.token_ids[self.offsets[t]:self.offsets[t + 1]]


@dataclass
class CompletionOutput:
    """One of a request's n samples. vLLM 0.34's fields in vLLM's order, so a positional call
    or a dataclasses.fields() walk written for vLLM lands on the same field here."""
    index: int  # which of the request's n samples
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # sum of the sampled tokens' logprobs (with logprobs)
    # Per generated token {token id: Logprob}: the sampled token first, then the top K (logprobs=K;
    # -1: the whole vocabulary), as vLLM orders them.
    logprobs: list[dict[int, Logprob]] | None
    # LLM(enable_return_routed_experts=True): numpy int16 [len(prompt) + len(token_ids) - 1, MoE layers,
    # top_k], the experts each computed position went to in each sparse layer (docs/moe.md).
    routed_experts: Any = None
    finish_reason: str | None = None  # "stop" (EOS, stop_token_ids, a stop string), "length", "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id; None for the EOS or a length
    lora_request: Any = None  # the LoRARequest it ran with (None: the base model)
    sampling_mask: SamplingMask | None = None  # SamplingParams(return_sampling_mask=True)
    spec_decode_metrics: Any = None  # always None: no speculative decoding here
    weight_versions: list | None = None  # vLLM's per-token spans; see RequestOutput.weight_version

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestStateStats:
    """RequestOutput.metrics: vLLM v1's fields under vLLM's names, then this engine's own.

    Every time is a time.time() stamp (vLLM's core stamps are monotonic: differences mean the
    same); a stamp is 0.0 until it happened, as in vLLM. With n > 1 the earliest schedule and
    first token of the samples, the latest last token, and the generated tokens of all of
    them. The request enters the engine's queue when it arrives, so queued_ts = arrival_time.
    Unlike vLLM's LLM (disable_log_stats=True leaves metrics None), every output carries one."""
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    arrival_time: float = 0.0
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    first_token_latency: float = 0.0  # first_token_ts - arrival_time
    is_corrupted: bool = False  # NaN logits are not detected here: always False
    is_watermarked: bool = False
    is_watermark_skipped: bool = False
    # This engine's own (and vLLM V0's names, which it had before).
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def first_scheduled_time(self) -> float | None:
        return self.scheduled_ts or None

    @property
    def first_token_time(self) -> float | None:
        return self.first_token_ts or None

    @property
    def last_token_time(self) -> float | None:
        return self.last_token_ts or None

    @property
    def time_in_queue(self) -> float | None:
        return self.scheduled_ts - self.arrival_time if self.scheduled_ts else None


RequestMetrics = RequestStateStats  # the name this engine gave it before


class RequestOutput:
    """One request's output. vLLM 0.34's constructor: the same positional order, names and
    defaults (and, as there, other keywords are accepted with a warning, so code written for a
    newer vLLM still runs). This engine's own fields come last, as keywords:

    weight_version: the version of the last completed update (LLM.finish_weight_update) when
    this output was made; a request that spans an update reports the version it finished
    under (None before any update)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                 prompt_logprobs: list[dict[int, Logprob] | None] | None, outputs: list[CompletionOutput],
                 finished: bool, metrics: RequestStateStats | None = None, lora_request: Any = None,
                 encoder_prompt: str | None = None, encoder_prompt_token_ids: list[int] | None = None,
                 num_cached_tokens: int | None = None, num_cache_creation_tokens: int | None = None, *,
                 prompt_token_id_logprobs: Any = None, kv_transfer_params: dict | None = None,
                 ec_transfer_params: dict | None = None, weight_version: int | str | None = None, **kwargs: Any):
        if kwargs:
            _warn_once(f"RequestOutput: ignoring extra arguments: {sorted(kwargs)}")
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        # prompt_logprobs=K: per prompt token {token id: Logprob}, None for the first (vLLM's shape).
        self.prompt_logprobs = prompt_logprobs
        self.prompt_token_id_logprobs = prompt_token_id_logprobs
        self.outputs, self.finished, self.metrics = outputs, finished, metrics
        self.lora_request = lora_request
        self.encoder_prompt, self.encoder_prompt_token_ids = encoder_prompt, encoder_prompt_token_ids
        # Prompt tokens the prefix cache supplied when the request was first scheduled.
        self.num_cached_tokens, self.num_cache_creation_tokens = num_cached_tokens, num_cache_creation_tokens
        self.kv_transfer_params, self.ec_transfer_params = kv_transfer_params, ec_transfer_params
        self.weight_version = weight_version

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """vLLM's: fold a later output of the same request into this one; `aggregate` joins
        DELTA outputs (text, tokens, logprobs, masks), otherwise each sample is replaced."""
        self.finished |= next_output.finished
        self.kv_transfer_params, self.ec_transfer_params = next_output.kv_transfer_params, next_output.ec_transfer_params
        self.weight_version, self.metrics = next_output.weight_version, next_output.metrics
        mine = {c.index: i for i, c in enumerate(self.outputs)}
        for nxt in next_output.outputs:
            if nxt.index not in mine:
                self.outputs.append(nxt)
            elif not aggregate:
                self.outputs[mine[nxt.index]] = nxt
            else:
                _join(self.outputs[mine[nxt.index]], nxt)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(self) == vars(other)

    def __repr__(self) -> str:
        return f"RequestOutput({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


def _join(completion: CompletionOutput, nxt: CompletionOutput) -> None:
    completion.text += nxt.text
    completion.token_ids = list(completion.token_ids) + list(nxt.token_ids)
    if nxt.logprobs:
        completion.logprobs = (completion.logprobs or []) + nxt.logprobs
    if nxt.sampling_mask is not None:
        mine = completion.sampling_mask or SamplingMask([], [0])
        shift = mine.offsets[-1]
        completion.sampling_mask = SamplingMask(mine.token_ids + nxt.sampling_mask.token_ids,
                                                mine.offsets + [shift + o for o in nxt.sampling_mask.offsets[1:]])
    if nxt.routed_experts is not None:  # it comes with the final output only
        completion.routed_experts = nxt.routed_experts
    completion.cumulative_logprob = nxt.cumulative_logprob
    completion.finish_reason, completion.stop_reason = nxt.finish_reason, nxt.stop_reason
    completion.weight_versions = nxt.weight_versions


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logging.getLogger("spmd_engine").warning(message)
