"""Deterministic continuous batching over a paged KV cache, with one token budget a step.

As vLLM V1: there are no prefill and decode phases. Each step has a budget of
`max_num_batched_tokens`; running requests are served first, in arrival
order (a decode costs one token, an unfinished prompt the next chunk of it),
then waiting requests are admitted while budget, `max_num_seqs` and free
blocks allow, each starting after its longest cached prefix. A long prompt
therefore enters in chunks beside the running decodes instead of stalling
them. When a running request cannot get a block, the newest running request
is preempted: its blocks are freed and it goes back to the front of the
queue, to be recomputed (mostly from the prefix cache) when room returns.

With pipeline parallelism under mp the engine keeps up to `pp_size` steps in
flight (vLLM's batch queue): a request whose step is still in flight has no
token to compute and is skipped, so the steps in flight hold disjoint requests,
each at most ceil(unfinished / in-flight limit) of them, and the stages
overlap. A request preempted while its step is in flight has that step's token
discarded when it comes back (it will be recomputed).

With async scheduling (vLLM's `async_scheduling`) the engine keeps two steps in
flight on any layout without PP: step k+1 is scheduled while step k runs, so the
host's scheduling and output processing overlap the forward. A request whose
step in flight samples is scheduled again at once, one token ahead: its input is
PLACEHOLDER_TOKEN_ID, which the runner replaces with the token it sampled for
that request in step k. It is not scheduled ahead when that token may be its
last by length (max_tokens, max_model_len), nor when it has structured outputs
(its grammar mask for step k+1 depends on that token); one that step k ends (EOS, a stop
token or string, an abort) has its step k+1 token dropped, and its freed blocks
are only written by later steps, which the workers run in order. Which tokens a
request gets is unchanged; only which step admits a waiting request can move.

Every rank of a replica under external_launcher runs its own copy of this
scheduler, so it decides the same batches from the same inputs: no clocks,
no hash-order iteration, sha256 block hashes.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

from spmd_engine.config import SchedulerConfig
from spmd_engine.core.kv_cache_manager import KVCacheManager
from spmd_engine.core.request import Request
from spmd_engine.core.step_messages import (
    PLACEHOLDER_TOKEN_ID,
    ModelRunnerOutput,
    NewRequestData,
    ScheduledSeq,
    SchedulerOutput,
)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 eos_token_id: int | Sequence[int] | None, max_loras: int = 0):
        """`eos_token_id`: one id or several (the model's first, then generation_config.json's
        others, e.g. Llama-3-Instruct's end-of-turn); any of them ends a request. `max_loras`:
        the most LoRA adapters one step may use (vLLM's): a request of another adapter waits."""
        if config.max_model_len is None or config.max_num_batched_tokens is None:
            raise ValueError("SchedulerConfig.resolve(max_model_len, block_size) first")
        self.config = config
        self.kv = kv
        ids = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self.eos_token_id = ids[0] if ids else None  # the model's own: finishes with stop_reason None
        self.eos_token_ids = frozenset(ids)
        self.max_loras = max_loras
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._known_to_runner: set[str] = set()
        self._finished_since_last_step: list[str] = []
        self._step = 0
        # (step, request id) -> the request's preemption count when that step was scheduled
        # to sample it: a token that comes back for an older count is stale and dropped.
        self._awaiting: dict[tuple[int, str], int] = {}
        self.stats = {"steps": 0, "preemptions": 0, "peak_running": 0,
                      "prefix_queries_tokens": 0, "prefix_hits_tokens": 0}

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -----------------------------------------------------------------
    def schedule(self, in_flight: int = 0, max_in_flight: int = 1) -> SchedulerOutput | None:
        """The next step. With `in_flight` steps not yet returned (of at most `max_in_flight`),
        requests in them are skipped, and None means nothing else can run until one returns."""
        finished, self._finished_since_last_step = self._finished_since_last_step, []
        self._step += 1
        budget = self.config.max_num_batched_tokens
        split = 1 if self.config.async_scheduling else max_in_flight  # PP's steps hold disjoint requests
        max_seqs = -(-(len(self.running) + len(self.waiting)) // split)
        seqs: list[ScheduledSeq] = []
        new: list[NewRequestData] = []
        loras: set[int] = set()  # the adapters this step uses
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0 and len(seqs) < max_seqs:
            request = self.running[i]
            n = min(self._tokens_to_compute(request), budget)
            if n == 0 or not self._lora_fits(request, loras):  # its step is in flight, or max_loras
                i += 1
                continue
            added = self.kv.allocate_slots(request, n)
            while added is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                added = self.kv.allocate_slots(request, n)
            if added is None:
                break
            seqs.append(self._scheduled(request, n, added, new_block_table=False))
            loras.add(request.lora_int_id)
            budget -= n
            i += 1
        if not preempted:
            budget = self._admit(budget, seqs, new, max_seqs, loras)
        if not seqs and in_flight:
            self._finished_since_last_step = finished  # they go with the next step sent
            self._step -= 1
            return None
        if not seqs and self.has_unfinished():
            raise RuntimeError(
                f"step {self._step}: nothing could be scheduled ({len(self.waiting)} waiting, "
                f"{self.kv.num_free_blocks} free blocks): the KV cache is too small for one request"
            )
        self.stats["steps"] += 1
        self.stats["peak_running"] = max(self.stats["peak_running"], len(self.running))
        out = SchedulerOutput(self._step, seqs, new, finished)
        out.active_loras = sorted(loras - {0})
        return out

    def _lora_fits(self, request: Request, loras: set[int]) -> bool:
        """Its adapter is the base model, already in this step, or one more within max_loras."""
        lora_id = request.lora_int_id
        return not lora_id or lora_id in loras or len(loras - {0}) < self.max_loras

    def _tokens_to_compute(self, request: Request) -> int:
        """The known tokens not yet computed; under async scheduling, when there are none, the
        one its step in flight samples (never one that may end it by length)."""
        known = request.num_tokens - request.num_computed_tokens
        if known or not request.num_output_placeholders:
            return known
        if request.params.structured_outputs is not None:  # its grammar mask needs that token first
            return 0
        ahead = request.num_tokens + request.num_output_placeholders
        if (len(request.output_token_ids) + request.num_output_placeholders >= request.params.max_tokens
                or ahead >= self.config.max_model_len):
            return 0
        return ahead - request.num_computed_tokens

    def _admit(self, budget: int, seqs: list[ScheduledSeq], new: list[NewRequestData], max_seqs: int,
               loras: set[int]) -> int:
        """Waiting requests in order, while the budget, max_num_seqs and free blocks allow; one
        whose LoRA adapter would exceed max_loras this step is passed over (it keeps its place)."""
        j = 0
        while (j < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs
               and len(seqs) < max_seqs):
            request = self.waiting[j]
            if not self._lora_fits(request, loras):
                j += 1
                continue
            # prompt_logprobs need every prompt position's logits: no prefix-cache hits (as vLLM).
            hits = [] if request.params.prompt_logprobs is not None else self.kv.get_computed_blocks(request)
            computed = self.kv.hit_tokens(hits)
            n = request.num_tokens - computed
            if n > budget and not self.config.enable_chunked_prefill:
                break
            n = min(n, budget)
            added = self.kv.allocate_slots(request, n, hits)
            if added is None:
                break
            del self.waiting[j]
            loras.add(request.lora_int_id)
            self.running.append(request)
            self.stats["prefix_queries_tokens"] += request.num_tokens
            self.stats["prefix_hits_tokens"] += computed
            request.num_computed_tokens = computed
            if request.num_cached_tokens < 0:  # the first admission's hits (vLLM's field)
                request.num_cached_tokens = computed
            if request.request_id not in self._known_to_runner:
                self._known_to_runner.add(request.request_id)
                new.append(self._new_request_data(request))
            seqs.append(self._scheduled(request, n, added, new_block_table=True))
            budget -= n
        return budget

    def _new_request_data(self, request: Request) -> NewRequestData:
        p = request.params
        stop_ids = sorted(self.eos_token_ids) + list(p.stop_token_ids or [])
        needs_prompt = p.repetition_penalty != 1.0 or p.prompt_logprobs is not None
        return NewRequestData(request.request_id, p, request.seed, request.num_prompt_tokens,
                              stop_ids if p.min_tokens else [],
                              list(request.prompt_token_ids) if needs_prompt else None, request.lora_int_id)

    def _scheduled(self, request: Request, n: int, added, new_block_table: bool) -> ScheduledSeq:
        start, known = request.num_computed_tokens, request.num_tokens
        request.num_computed_tokens = start + n  # counted now, as vLLM: the step is in flight
        sample = start + n == known + request.num_output_placeholders
        if sample:
            self._awaiting[(self._step, request.request_id)] = request.num_preemptions
            if self.config.async_scheduling:
                request.num_output_placeholders += 1
        token_ids = request.token_slice(start, min(start + n, known))
        if start + n > known:  # tokens steps in flight are sampling
            token_ids = token_ids + [PLACEHOLDER_TOKEN_ID] * (start + n - max(start, known))
        return ScheduledSeq(request.request_id, token_ids, start, added, new_block_table, sample=sample)

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: free everything, requeue at the front."""
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # the tokens in flight are dropped when they return
        request.num_preemptions += 1
        self.stats["preemptions"] += 1
        self.waiting.appendleft(request)

    # -- results --------------------------------------------------------------------
    # Set by the engine for a model whose cached keys go stale as a request grows (Phi-3's
    # longrope, model/layers/longrope.py): called with a request just given a token; True: its
    # KV is recomputed from the start.
    stale_cache = None

    def update_from_output(self, out: SchedulerOutput, model_output: ModelRunnerOutput) -> list[Request]:
        """Append each sampled token; return the requests that finished this step."""
        sampling = [s.request_id for s in out.seqs if s.sample]
        if model_output.request_ids != sampling:
            raise RuntimeError(
                f"step {out.step}: the model replied for {model_output.request_ids}, "
                f"expected samples for {sampling}"
            )
        by_id = {r.request_id: r for r in self.running}
        if model_output.prompt_logprobs:  # kept even if preempted in flight: the runner moved on
            known = {r.request_id: r for r in (*self.running, *self.waiting)}
            for rid, entries in model_output.prompt_logprobs.items():
                if rid in known:  # not aborted while this step was in flight
                    known[rid].prompt_logprobs = known[rid].prompt_logprobs or []
                    known[rid].prompt_logprobs.extend(entries)
        if model_output.routed_experts:
            self._record_routed_experts(model_output.routed_experts)
        finished = []
        for i, (rid, token) in enumerate(zip(model_output.request_ids, model_output.sampled_token_ids)):
            request, epoch = by_id.get(rid), self._awaiting.pop((out.step, rid))
            if request is None or request.num_preemptions != epoch:
                continue  # preempted while this step was in flight: it is being recomputed
            if request.num_output_placeholders:
                request.num_output_placeholders -= 1
            request.output_token_ids.append(int(token))
            if model_output.logprobs is not None and model_output.logprobs[i] is not None:
                request.logprobs = request.logprobs or []
                request.logprobs.append(model_output.logprobs[i])
            if model_output.sampling_masks is not None and model_output.sampling_masks[i] is not None:
                request.sampling_masks = request.sampling_masks or []
                request.sampling_masks.append(model_output.sampling_masks[i])
            reason = self._finish_reason(request, int(token))
            if reason:
                request.finish_reason = reason
                finished.append(request)
            elif self.stale_cache is not None and self.stale_cache(request):
                self.running.remove(request)
                self._preempt(request)  # recomputed from its first token when next admitted
        for request in finished:
            self.finish_request(request)
        return finished

    def _record_routed_experts(self, routed: dict) -> None:
        """Kept even if preempted in flight (as prompt logprobs): the rows are of known tokens at
        known positions, and a recomputation overwrites them."""
        known = {r.request_id: r for r in (*self.running, *self.waiting)}
        for rid, chunk in routed.items():
            request = known.get(rid)
            if request is not None:
                if request.routed_experts is None:
                    request.routed_experts = []
                request.routed_experts.append(chunk)

    def finish_request(self, request: Request) -> None:
        """Take a running request out (its finish_reason already set): free its blocks, and
        tell the runner at the next step."""
        self.running.remove(request)
        self.kv.free(request)
        self._known_to_runner.discard(request.request_id)
        self._finished_since_last_step.append(request.request_id)

    def abort_requests(self, request_ids: Sequence[str]) -> list[Request]:
        """Finish these unfinished requests with finish_reason "abort", keeping their tokens so
        far; their blocks are freed now. Ids not unfinished here are skipped (vLLM's no-op)."""
        wanted = set(request_ids)
        aborted = [r for r in (*self.running, *self.waiting) if r.request_id in wanted]
        for request in aborted:
            request.finish_reason = "abort"
            if request in self.running:
                self.finish_request(request)
                continue
            self.waiting.remove(request)  # waiting requests hold no blocks
            if request.request_id in self._known_to_runner:  # preempted: the runner still keeps it
                self._known_to_runner.discard(request.request_id)
                self._finished_since_last_step.append(request.request_id)
        return aborted

    def reset_running_requests(self) -> int:
        """Every running request gives its blocks back and goes to the front of the queue,
        in its order, keeping its tokens: its KV is recomputed when next scheduled (after a
        weight update the old KV is stale). Counted as preemptions. Returns how many."""
        victims = list(self.running)
        self.running.clear()
        for request in reversed(victims):
            self._preempt(request)
        return len(victims)

    def _finish_reason(self, request: Request, token: int) -> str | None:
        p = request.params
        if len(request.output_token_ids) >= p.min_tokens:
            if token in self.eos_token_ids and not p.ignore_eos:
                if token != self.eos_token_id:
                    request.stop_reason = token  # vLLM: generation_config's other EOS ids act as stop ids
                return "stop"
            if p.stop_token_ids and token in p.stop_token_ids:
                request.stop_reason = token  # kept in the output, as vLLM
                return "stop"
        if len(request.output_token_ids) >= p.max_tokens:
            return "length"
        if request.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def get_stats(self) -> dict:
        kv = self.kv
        return {**self.stats, "running": len(self.running), "waiting": len(self.waiting),
                "num_blocks": kv.pool.num_blocks, "free_blocks": kv.num_free_blocks,
                "cached_blocks": kv.pool.num_cached_blocks, "block_size": kv.block_size}
