"""A request's life in the engine.

The step messages the scheduler sends to the model runner live in
`spmd_engine.core.step_messages` (re-exported here for callers that import them
from the engine).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spmd_engine.core.step_messages import (  # noqa: F401  (re-exported)
    EMPTY_MODEL_RUNNER_OUTPUT,
    ModelRunnerOutput,
    NewRequestData,
    ScheduledSeq,
    SchedulerOutput,
)
from spmd_engine.sampling_params import SamplingParams


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, tuple[float, int]]] | None = None
    num_computed_tokens: int = 0  # tokens whose K/V are in this request's blocks
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string (or a non-primary EOS id) that ended it
    # The text so far, kept only while stop strings are watched (spmd_engine.engine.stop_strings);
    # cut at the stop string once found. None: the front end decodes the tokens at the end.
    output_text: str | None = None
    prompt_logprobs: list[dict[int, tuple[float, int]]] | None = None  # prompt tokens 1..P-1
    sampling_masks: list | None = None  # per output token, the ids it could have been drawn from
    num_preemptions: int = 0
    # Tokens that steps in flight will sample (async scheduling): already fed to a later step
    # as PLACEHOLDER_TOKEN_ID, appended when their step returns.
    num_output_placeholders: int = 0
    # Prompt tokens found in the prefix cache when first scheduled (vLLM's num_cached_tokens); -1 before.
    num_cached_tokens: int = -1
    # time.time() stamps for metrics only (nothing decides by them; the scheduler reads no clock):
    # the front end's arrival, the core's first schedule and first and last new token.
    arrival_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    # Routing replay: (first position, rows) as steps computed them (core/routed_experts.py).
    routed_experts: list[tuple[int, Any]] | None = field(default=None, repr=False)
    # Chain hashes of this request's full blocks, computed once each (prefix caching).
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    # The LoRA adapter it runs with (0: the base model) and what its first block's hash chains
    # from: the adapter's identity and load, so a cached prefix is found only under the same one.
    lora_int_id: int = 0
    cache_root: bytes | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output, without building the whole list."""
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p:stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - p]
