"""Deterministic continuous batching under a fixed KV budget.

Every rank of a replica under external_launcher runs its own copy of this
scheduler, so it must decide the same batches from the same inputs: no clocks,
no hash-order iteration, slots handed out lowest first. A step either prefills
newly admitted requests or decodes every running one; requests wait while all
KV slots are taken and enter as others finish.
"""

from __future__ import annotations

from collections import deque

from spmd_engine.engine.request import (
    ModelRunnerOutput, NewRequestData, Request, ScheduledSeq, SchedulerOutput,
)


class Scheduler:
    def __init__(self, num_slots: int, max_model_len: int, eos_token_id: int | None,
                 max_num_batched_tokens: int | None = None):
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.max_num_batched_tokens = max_num_batched_tokens or max(2048, max_model_len)
        self.free_slots = list(range(num_slots))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_since_last_step: list[str] = []
        self._step = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        finished, self._finished_since_last_step = self._finished_since_last_step, []
        self._step += 1
        admitted = self._admit()
        if admitted:
            seqs = [ScheduledSeq(r.request_id, r.slot, list(r.prompt_token_ids), 0) for r in admitted]
            new = [NewRequestData(r.request_id, r.params, r.seed) for r in admitted]
            return SchedulerOutput(self._step, seqs, new, finished)
        seqs = [ScheduledSeq(r.request_id, r.slot, [r.output_token_ids[-1]], r.num_computed_tokens)
                for r in self.running]
        return SchedulerOutput(self._step, seqs, [], finished)

    def _admit(self) -> list[Request]:
        admitted: list[Request] = []
        budget = self.max_num_batched_tokens
        while self.waiting and self.free_slots:
            need = len(self.waiting[0].prompt_token_ids)
            if admitted and need > budget:
                break
            request = self.waiting.popleft()
            request.slot = self.free_slots.pop(0)
            budget -= need
            admitted.append(request)
        self.running.extend(admitted)
        return admitted

    def update_from_output(self, out: SchedulerOutput, model_output: ModelRunnerOutput) -> list[Request]:
        """Append each sampled token; return the requests that finished this step."""
        by_id = {r.request_id: r for r in self.running}
        if model_output.request_ids != [s.request_id for s in out.seqs]:
            raise RuntimeError(
                f"step {out.step}: the model replied for {model_output.request_ids}, "
                f"scheduled {[s.request_id for s in out.seqs]}"
            )
        finished = []
        for i, (seq, token) in enumerate(zip(out.seqs, model_output.sampled_token_ids)):
            request = by_id[seq.request_id]
            request.num_computed_tokens = seq.context_len + len(seq.token_ids)
            request.output_token_ids.append(int(token))
            if model_output.logprobs is not None and model_output.logprobs[i] is not None:
                request.logprobs = (request.logprobs or []) + [model_output.logprobs[i]]
            reason = self._finish_reason(request, int(token))
            if reason:
                request.finish_reason = reason
                finished.append(request)
        for request in finished:
            self.running.remove(request)
            self.free_slots.append(request.slot)
            self.free_slots.sort()
            self._finished_since_last_step.append(request.request_id)
        return finished

    def _finish_reason(self, request: Request, token: int) -> str | None:
        if token == self.eos_token_id and not request.params.ignore_eos:
            return "stop"
        if len(request.output_token_ids) >= request.params.max_tokens:
            return "length"
        if request.num_tokens >= self.max_model_len:
            return "length"
        return None
