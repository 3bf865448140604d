"""What generate() returns, shaped like vLLM's RequestOutput so users' code carries over."""

from __future__ import annotations

from dataclasses import dataclass, field
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
    index: int  # which of the request's n samples
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS, stop_token_ids, a stop string), "length" (max_tokens or max_model_len)
    # Per generated token {token id: Logprob}: the sampled token, and the top K (logprobs=K).
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs (with logprobs)
    stop_reason: int | str | None = None  # the stop string or stop token id; None for the EOS or a length
    sampling_mask: SamplingMask | None = None  # SamplingParams(return_sampling_mask=True)
    # LLM(enable_return_routed_experts=True): numpy int16 [len(prompt) + len(token_ids) - 1, MoE layers,
    # top_k], the experts each computed position went to in each sparse layer (docs/moe.md).
    routed_experts: Any = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """One request's times (time.time() seconds; None until it happened) and token counts.
    With n > 1 the earliest schedule and first token of its samples, the latest last token,
    and the generated tokens of all of them."""
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def time_in_queue(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def first_token_latency(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    # prompt_logprobs=K: per prompt token {token id: Logprob}, None for the first (vLLM's shape).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # The version of the last completed update (LLM.finish_weight_update) when this output was made:
    # a request that spans an update reports the version it finished under (None before any update).
    weight_version: int | str | None = None
    # Prompt tokens the prefix cache supplied when the request was first scheduled (vLLM's field).
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
