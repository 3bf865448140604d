"""`llm.llm_engine`: vLLM's LLMEngine surface for online and agentic rollouts.

`add_request(request_id, prompt, params)` queues a request, `step()` runs one engine
step and returns a RequestOutput for every request that made progress (in its
SamplingParams.output_kind), `abort_request(ids)` finishes requests early (each
output comes back once, from the next step(), finish_reason "abort", its tokens
so far). `LLM.generate` is a loop over these same calls.

Under external_launcher each rank of a replica drives its own copy of the engine:
the adds and aborts are applied at the next sync point after an exchange across
the replica (engine/admission.py), so every rank schedules the same batches.
step(), has_unfinished_requests() and get_num_unfinished_requests() are then
collective over the replica: every rank calls them in the same order. With DP
waves (a mixture of experts under DP) step() and has_unfinished_requests() are
also collective over the DP replicas, which all loop together.
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable, Iterable

from spmd_engine.config import ConfigError
from spmd_engine.engine.core_client import EngineCoreClient, EngineDeadError
from spmd_engine.engine.output_processor import NewRequest, OutputProcessor
from spmd_engine.engine.outputs import RequestOutput
from spmd_engine.engine.pause import PauseState
from spmd_engine.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, client: EngineCoreClient, inputs, seed: int, admission: str, external: bool,
                 weight_version: Callable[[], Any], preflight: Callable[[], None]):
        self._client, self.inputs, self.seed = client, inputs, seed
        # Requests without a seed draw theirs from here, in the order added: fresh randomness on
        # every call, yet the same on every rank given the same engine seed.
        self.seed_stream = random.Random(seed)
        self.outputs = OutputProcessor(inputs, weight_version)
        self._preflight = preflight
        self._queue: list[tuple[str, Any]] = []  # ("add", NewRequest) / ("abort", [ids]), not applied yet
        self._aborted: list[tuple[Any, RequestOutput]] = []  # returned by the next step()
        self.pause = PauseState()
        self._exchange = None
        if external:
            from spmd_engine.engine.admission import ReplicaExchange
            self._exchange = ReplicaExchange(admission, seed)

    # -- what trainers reach through llm.llm_engine (vLLM's names) ----------------------
    @property
    def engine_core(self):
        """The EngineCore when it lives in this process, else the DP client of its processes."""
        return self._client.llm_engine

    @property
    def model_executor(self):
        return self.engine_core.model_executor

    @property
    def vllm_config(self):
        return self._client.vllm_config

    # -- the request API ---------------------------------------------------------------
    @property
    def takes_input(self) -> bool:
        """False on the ranks that admission="rank0" leaves to follow the first rank."""
        return self._exchange is None or self._exchange.takes_input

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request: `prompt` a string, token ids, {"prompt": ...} or {"prompt_token_ids": ...}.
        A request id still unfinished is a ValueError; a finished one's id may be used again."""
        self.queue_request(self.new_request(request_id, prompt, params, arrival_time))

    def new_request(self, request_id: str, prompt, params: SamplingParams | None, arrival_time=None,
                    origin=None, index: int = 0) -> NewRequest:
        """The request tokenized, checked and seeded (nothing queued: generate checks every
        prompt before it queues any)."""
        self._check_takes_input("add_request")
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id in self.outputs.states or any(k == "add" and e.request_id == request_id for k, e in self._queue):
            raise ValueError(f"request id {request_id!r} is already running")
        text, ids = self.inputs.encode(prompt, index)
        self.inputs.check_params(params, index)
        if params.stop and self.inputs.tokenizer is None:
            raise ConfigError(f"prompt {index}: stop strings need a tokenizer, and this model has none "
                              f"({self.inputs._tokenizer_error})")
        seed = params.seed if params.seed is not None else self.seed_stream.getrandbits(63)
        return NewRequest(request_id, text, ids, params, seed, time.time() if arrival_time is None else arrival_time,
                          origin)

    def queue_request(self, new: NewRequest) -> None:
        self._queue.append(("add", new))
        if self._exchange is None:
            self._apply(self._take_queue())

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Finish these requests: their outputs (finish_reason "abort", the tokens so far) come
        back once, from the next step(). Ids that are not unfinished are skipped (vLLM's no-op)."""
        self._check_takes_input("abort_request")
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        if not all(isinstance(i, str) for i in ids):
            raise TypeError(f"request ids must be strings, got {ids!r}")
        self._queue.append(("abort", ids))
        if self._exchange is None:
            self._apply(self._take_queue())

    def step(self) -> list[RequestOutput]:
        return [out for _, out in self.step_with_origins()]

    def step_with_origins(self, sync: bool = True) -> list[tuple[Any, RequestOutput]]:
        """step(), each output with the (generate call, position) it came from (None: added).
        `sync=False`: no exchange first (generate's loop, which exchanged its whole queue once
        and into which nothing can be queued)."""
        self._preflight()
        if sync:
            self.sync()
        elif self._queue:
            raise RuntimeError("add_request / abort_request while LLM.generate runs (from one of its "
                               "callbacks) is not supported: the other ranks would not see it")
        if self.pause.paused:
            raise RuntimeError(f"step() while generation is paused (mode={self.pause.mode!r}): "
                               f"resume_generation() first")
        aborted, self._aborted = self._aborted, []
        try:
            progressed = self._client.step()
        except EngineDeadError as exc:
            exc.outputs = aborted + self.outputs.process(exc.finished)
            self.outputs.drop_unfinished()
            raise
        return aborted + self.outputs.process(progressed)

    def has_unfinished_requests(self, sync: bool = True) -> bool:
        if sync:
            self.sync()
        return bool(self._aborted) or self._client.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        """User requests not finished (a request with n samples counts once)."""
        self.sync()
        return self.outputs.num_unfinished

    # -- the sync point --------------------------------------------------------------------
    def sync(self) -> None:
        """Apply what was queued since the last sync (after the exchange under external_launcher)."""
        queued = self._take_queue()
        if self._exchange is not None:
            self._exchange.seed = self.seed
            core = self._client.llm_engine
            queued = self._exchange.exchange(queued, self.pause.paused, core.last_step_digest)
        self._apply(queued)

    def _take_queue(self) -> list[tuple[str, Any]]:
        queued, self._queue = self._queue, []
        return queued

    def _apply(self, queued: list[tuple[str, Any]]) -> None:
        for kind, item in queued:
            if kind == "add":
                for request in self.outputs.add(item):
                    self._client.add_request(request)
            else:
                self._aborted += self.abort_now(item)

    def abort_now(self, request_ids: list[str]) -> list[tuple[Any, RequestOutput]]:
        aborted = self._client.abort_requests(self.outputs.engine_ids(request_ids))
        return self.outputs.process(aborted)

    def _check_takes_input(self, what: str) -> None:
        if not self.takes_input:
            raise RuntimeError(f"{what} on a rank that follows the replica's first rank (admission='rank0'): "
                               f"only the first rank adds and aborts requests; the others call step()")

    # -- pausing (engine/pause.py) -----------------------------------------------------------
    def pause_generation(self, mode: str = "abort", clear_cache: bool = False) -> list[RequestOutput]:
        from spmd_engine.engine.pause import pause
        return pause(self, mode, clear_cache)

    def resume_generation(self) -> None:
        from spmd_engine.engine.pause import resume
        resume(self)

    def is_paused(self) -> bool:
        return self.pause.paused
