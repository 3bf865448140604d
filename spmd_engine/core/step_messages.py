"""The messages of one engine step: scheduler -> model runner, and back.

Both the engine (scheduler) and the model runner import this module, and
nothing else of each other. The messages are plain dataclasses of ints and
lists: under mp they cross the shared-memory queue to every worker each step,
so they stay small. A request's sampling settings and prompt length travel once
(NewRequestData); its block table travels as the blocks it gains each step
(the whole table only when it is first scheduled or resumed after preemption).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spmd_engine.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """Sent once, when a request is first scheduled: what the runner keeps about it.

    `stop_ids` (EOS and stop_token_ids) are masked while under min_tokens; the
    prompt's ids travel only when repetition_penalty or prompt_logprobs need them.
    """

    request_id: str
    params: SamplingParams
    seed: int
    num_prompt_tokens: int
    stop_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    lora_int_id: int = 0  # the adapter it runs with (0: the base model)


PLACEHOLDER_TOKEN_ID = -1  # not a vocabulary id: an embedding lookup of it fails loudly


@dataclass
class ScheduledSeq:
    """One request's share of a step.

    `token_ids` are computed this step, at positions context_len ...
    context_len + len(token_ids) - 1 (context_len tokens of this request are
    already in the KV cache, computed earlier or found in the prefix cache).
    `block_ids` extend the request's block table, or replace it when
    `new_block_table` (first schedule, or resumed after preemption). `sample`:
    this step reaches the end of the known tokens, so a new token is sampled;
    a prompt chunk that does not finish its prompt samples nothing. Under async
    scheduling a token id may be PLACEHOLDER_TOKEN_ID: the token the previous step
    (still in flight when this one was scheduled) sampled for this request, which
    the runner fills in from its own sampler. With a KV cache of several groups (a model
    mixing full and sliding-window layers, core/kv_groups.py) `block_ids` is a tuple of one
    such list per group, in the groups' order.
    """

    request_id: str
    token_ids: list[int]
    context_len: int
    block_ids: list[int] | tuple[list[int], ...]
    new_block_table: bool
    sample: bool


@dataclass
class GrammarBitmask:
    """Structured outputs: the ids each constrained request may sample this step, packed as the
    grammar backend fills them (bit j of word i allows id 32 * i + j), one row per request id.
    Computed by the engine from (constraint, tokens so far) only, so every rank that runs its
    own engine (external_launcher) ships the same rows; a request whose grammar has ended has
    no row (it samples unconstrained, as vLLM)."""

    request_ids: list[str]
    bitmask: Any  # numpy int32 [len(request_ids), ceil(vocab / 32)]


@dataclass
class AdapterSource:
    """A LoRA adapter a rank must load: its PEFT directory, or (`in_memory`) the
    (peft_config, tensors) a trainer handed over."""

    lora_int_id: int
    lora_name: str
    lora_path: str
    in_memory: tuple[dict, dict] | None = None


@dataclass
class SchedulerOutput:
    """`lora_loads` / `lora_evictions`: adapters every rank loads / drops before this step
    (engine/lora_adapters.py decides, so the ranks' loaded sets stay equal)."""

    step: int
    seqs: list[ScheduledSeq]
    new_requests: list[NewRequestData]
    finished_request_ids: list[str]
    lora_loads: list[AdapterSource] = field(default_factory=list)
    lora_evictions: list[int] = field(default_factory=list)
    active_loras: list[int] = field(default_factory=list)  # the adapter ids this step's requests use
    grammar: GrammarBitmask | None = None  # set by the engine after scheduling (structured outputs)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass
class ModelRunnerOutput:
    """The output rank's reply: one sampled token per sampling sequence, in schedule order.
    `prompt_logprobs`: per request that asked, the entries of the prompt tokens computed this
    step ({token id: (logprob, rank)} each, in prompt order, the first prompt token excluded).
    `sampling_masks`: per sampled row, the ids it could have drawn (a sorted int32 array) for
    requests with return_sampling_mask, else None.
    `routed_experts` (LLM(enable_return_routed_experts=True)): per request computed this step,
    (first position, numpy int16 rows [positions, MoE layers, top_k]) (worker/routing_replay.py)."""

    request_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[dict[int, tuple[float, int]] | None] | None = None
    prompt_logprobs: dict[str, list[dict[int, tuple[float, int]]]] | None = None
    sampling_masks: list | None = None
    routed_experts: dict[str, tuple[int, Any]] | None = None


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput([], [], None)
