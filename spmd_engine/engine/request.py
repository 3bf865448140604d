"""A request's life in the engine, and the messages that describe one step.

The step messages are plain dataclasses of ints and lists: they cross the
shared-memory queue to every worker each step, so they stay small (a decode
step carries one token per sequence, sampling settings travel once).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spmd_engine.sampling_params import SamplingParams


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    slot: int | None = None
    num_computed_tokens: int = 0
    finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass
class NewRequestData:
    """Sent once, when a request is first scheduled: what the sampler needs."""

    request_id: str
    params: SamplingParams
    seed: int


@dataclass
class ScheduledSeq:
    request_id: str
    slot: int
    token_ids: list[int]  # fed this step
    context_len: int      # tokens already in this sequence's KV cache


@dataclass
class SchedulerOutput:
    step: int
    seqs: list[ScheduledSeq]
    new_requests: list[NewRequestData]
    finished_request_ids: list[str]

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass
class ModelRunnerOutput:
    """The output rank's reply: one sampled token per scheduled sequence, in order."""

    request_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[dict[int, float] | None] | None = None


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput([], [], None)
