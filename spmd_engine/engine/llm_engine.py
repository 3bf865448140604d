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

import copy
import functools
import random
import threading
import time
from typing import Any, Iterable

from spmd_engine.config import ConfigError
from spmd_engine.engine.core_client import EngineCoreClient, EngineDeadError
from spmd_engine.engine.output_processor import NewRequest, OutputProcessor
from spmd_engine.engine.outputs import RequestOutput
from spmd_engine.engine.pause import PauseState
from spmd_engine.engine.sleep_mode import SleepMode
from spmd_engine.engine.weight_update import WeightUpdates
from spmd_engine.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, client: EngineCoreClient, inputs, seed: int, admission: str, external: bool,
                 enable_sleep_mode: bool = False, config=None):
        self._client, self.inputs, self.seed = client, inputs, seed
        self.config = config
        # Requests without a seed draw theirs from here, in the order added: fresh randomness on
        # every call, yet the same on every rank given the same engine seed.
        self.seed_stream = random.Random(seed)
        self.updates = WeightUpdates(client, external)
        self.sleep_mode = SleepMode(enable_sleep_mode)
        self.outputs = OutputProcessor(inputs, lambda: self.updates.version)
        self._queue: list[tuple[str, Any]] = []  # ("add", NewRequest) / ("abort", [ids]), not applied yet
        self._aborted: list[tuple[Any, RequestOutput]] = []  # returned by the next step()
        self.pause = PauseState()
        self.dead: str | None = None  # why every later call is refused (a collective_rpc timed out)
        self._exchange = None
        if external:
            from spmd_engine.engine.admission import ReplicaExchange
            self._exchange = ReplicaExchange(admission, seed)

    @classmethod
    def from_engine_args(cls, engine_args) -> "LLMEngine":
        """vLLM's: an engine of its own, driven by add_request / step (torchtitan's generator
        under torchrun). It lives until shutdown() or until it is garbage collected."""
        from spmd_engine.engine.llm import LLM
        return LLM.from_engine_args(engine_args).llm_engine

    @classmethod
    def from_setup(cls, setup, admission: str = "identical", enable_sleep_mode: bool = False) -> "LLMEngine":
        """The engine's processes built on a checked configuration."""
        from spmd_engine.engine.core_client import make_client
        config = setup.config
        external = config.parallel_config.distributed_executor_backend == "external_launcher"
        return cls(make_client(config, setup.inputs), setup.inputs, config.seed, admission, external,
                   enable_sleep_mode, config)

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

    @property
    def model_config(self):
        """vLLM's `llm_engine.model_config` (lm-evaluation-harness reads it when it starts)."""
        return self.vllm_config.model_config

    def reset_mm_cache(self) -> None:
        """vLLM's: clear the multimodal processor cache. There is none here (text only); ms-swift
        calls it once its engine is built."""

    def reset_encoder_cache(self) -> None:
        """vLLM's (0.16+): clear the encoder cache. There is none here; ms-swift calls it after
        every weight update."""

    @property
    def renderer(self):
        """vLLM's prompt renderer (engine/renderer.py)."""
        from spmd_engine.engine.renderer import Renderer
        return Renderer(self.inputs)

    def get_tokenizer(self):
        if self.inputs.tokenizer is None:
            raise RuntimeError(f"this engine has no tokenizer ({self.inputs._tokenizer_error})")
        return self.inputs.tokenizer

    @property
    def tokenizer(self):
        """vLLM's: the tokenizer, or None without one (skip_tokenizer_init, no tokenizer files)."""
        return self.inputs.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the checkpoint's generation_config.json sampling values (generation_config="auto"),
        vLLM's defaults for the rest."""
        return SamplingParams.from_optional(**self.inputs.default_sampling_kwargs)

    # -- the control surface trainers call (vLLM's llm.llm_engine methods) ------------------
    def collective_rpc(self, method, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None, *, unique_reply_rank: int | None = None) -> list[Any]:
        """A Worker method (or a callable taking the worker) on every worker of each replica this
        process drives. `timeout` (seconds) as vLLM's: a TimeoutError past it. The call may still
        be running in the workers then, so their state is unknown: every later call is refused."""
        self._check_alive()
        if timeout is None:
            return self.call_workers(method, args, kwargs, unique_reply_rank)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"collective_rpc timeout must be a number of seconds > 0 or None, got {timeout!r}")
        result: dict = {}

        def call() -> None:
            try:
                result["value"] = self.call_workers(method, args, kwargs, unique_reply_rank)
            except BaseException as exc:  # handed to the caller's thread below
                result["error"] = exc
        thread = threading.Thread(target=call, name="collective_rpc", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            name = method if isinstance(method, str) else getattr(method, "__name__", "callable")
            self.dead = (f"collective_rpc({name!r}) timed out after {timeout} s and may still be running "
                         f"in the workers")
            raise TimeoutError(self.dead)
        if "error" in result:
            raise result["error"]
        return result["value"]

    def _check_alive(self) -> None:
        if self.dead:
            raise RuntimeError(f"the engine refuses every call: {self.dead}; shut it down and start a new one")

    def call_workers(self, method, args: tuple = (), kwargs: dict | None = None,
                     unique_reply_rank: int | None = None) -> list[Any]:
        """collective_rpc without a timeout; `load_weights` checked here first (a bad name or
        shape is a ValueError before any worker sees it) and counted by the weight update."""
        if method == "load_weights":
            try:
                args = (checked_weights(self._hf_shapes, self._model_spec.architecture, *args, **(kwargs or {})),)
            except Exception as exc:
                self.updates.note_load_error(exc)
                raise
            kwargs = None
        return self._client.collective_rpc(method, args, kwargs, unique_reply_rank)

    @functools.cached_property
    def _model_spec(self):
        from spmd_engine.model.spec import ModelSpec
        return ModelSpec.from_hf_config(self.inputs.hf_config, "config.json")

    @functools.cached_property
    def _hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """The model's full HF tensor shapes, worked out once (a trainer pushes tensor by tensor)."""
        from spmd_engine.model.weights import hf_tensor_shapes
        return hf_tensor_shapes(self._model_spec)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached prefix block (as vLLM: False while requests are running).
        `reset_running_requests=True`: running requests keep their tokens and recompute their KV
        when next scheduled (after a weight update their old KV is stale); it always succeeds.
        `reset_connector` (vLLM's KV connector) has nothing to reset here."""
        if not isinstance(reset_running_requests, bool):
            raise ValueError(f"reset_running_requests must be True or False, got {reset_running_requests!r}")
        return all(self._client.call_core("reset_prefix_cache", reset_running_requests))

    def sleep(self, level: int = 1, mode: str = "abort", reset_connector: bool = True) -> list[dict]:
        return self.sleep_mode.sleep(self, level, mode)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        return self.sleep_mode.wake_up(self, tags)

    def is_sleeping(self) -> bool:
        return bool(self.sleep_mode.asleep)

    def check_can_generate(self) -> None:
        """Refuse to run the model on weights that are not a whole policy, or while asleep."""
        self._check_alive()
        self.sleep_mode.check_awake()
        self.updates.check_can_generate()
        self.sleep_mode.check_weights_loaded(self._client.collective_rpc)

    # -- versioned weight updates (engine/weight_update.py) ------------------------------
    def start_weight_update(self) -> None:
        self.updates.start()

    def finish_weight_update(self, weight_version: str | int | None = None) -> None:
        self.updates.finish(weight_version)

    def get_weight_version(self) -> str | int:
        return self.updates.get_version()

    def update_weight_version(self, new_version: str | int) -> None:
        self.updates.set_version(new_version)

    # -- LoRA adapters (vLLM's llm_engine methods; engine/lora_adapters.py) -------------------
    def add_lora(self, lora_request) -> bool:
        """Load an adapter on every rank of every replica this process drives (again, replacing
        it, with `load_inplace=True`); a bad adapter is a LoRAAdapterError naming it and why."""
        self._check_alive()
        return all(self._client.call_core("add_lora", lora_request))

    def remove_lora(self, lora_id: int) -> bool:
        self._check_alive()
        return all(self._client.call_core("remove_lora", lora_id))

    def list_loras(self) -> set[int]:
        return set().union(*self._client.call_core("list_loras"))

    def pin_lora(self, lora_id: int) -> bool:
        return all(self._client.call_core("pin_lora", lora_id))

    def use_loras(self, lora_requests) -> None:
        """The adapters requests are about to run with, loaded first (vLLM loads a request's
        adapter when it is scheduled); one with `load_inplace=True` is loaded again, once."""
        seen: set[int] = set()
        for request in lora_requests:
            if request is None or request.lora_int_id in seen:
                continue
            seen.add(request.lora_int_id)
            self.add_lora(request)  # a known one is only checked (name and id) unless load_inplace

    # -- the request API ---------------------------------------------------------------
    @property
    def takes_input(self) -> bool:
        """False on the ranks that admission="rank0" leaves to follow the first rank."""
        return self._exchange is None or self._exchange.takes_input

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, lora_request=None, tokenization_kwargs: dict | None = None,
                    trace_headers=None, priority: int = 0, prompt_text: str | None = None) -> str:
        """Queue a request: `prompt` a string, token ids, {"prompt": ...} or {"prompt_token_ids": ...};
        returns its id (vLLM's). A request id still unfinished is a ValueError; a finished one's id
        may be used again. `params` None: the model's default sampling parameters."""
        check_request_extras(lora_request, priority)
        self.use_loras([lora_request])
        new = self.new_request(request_id, prompt, params, arrival_time,
                               tokenization_kwargs=tokenization_kwargs, lora_request=lora_request)
        self.queue_request(new)
        return request_id

    def new_request(self, request_id: str, prompt, params: SamplingParams | None, arrival_time=None,
                    origin=None, index: int = 0, tokenization_kwargs: dict | None = None,
                    lora_request=None) -> NewRequest:
        """The request tokenized, checked and seeded (nothing queued: generate checks every
        prompt before it queues any). Its `lora_request` must be loaded (use_loras)."""
        self._check_takes_input("add_request")
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        params = self.get_default_sampling_params() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id in self.outputs.states or any(k == "add" and e.request_id == request_id for k, e in self._queue):
            raise ValueError(f"request id {request_id!r} is already running")
        text, ids = self.inputs.encode(prompt, index, tokenization_kwargs)
        if params.max_tokens is None:  # vLLM: up to the model's context
            params = copy.copy(params)
            params.max_tokens = self.inputs.max_model_len - len(ids)
        if self.inputs.return_sampling_mask and not params.return_sampling_mask:  # vLLM's engine-wide switch
            params = copy.copy(params)
            params.return_sampling_mask = True
        self.inputs.check_params(params, index)
        if params.stop and self.inputs.tokenizer is None:
            raise ConfigError(f"prompt {index}: stop strings need a tokenizer, and this model has none "
                              f"({self.inputs._tokenizer_error})")
        seed = params.seed if params.seed is not None else self.seed_stream.getrandbits(63)
        return NewRequest(request_id, text, ids, params, seed, time.time() if arrival_time is None else arrival_time,
                          origin, _light(lora_request))

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
        self.check_can_generate()
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

    def keep_for_next_step(self, outputs: list[RequestOutput]) -> None:
        self._aborted += [(None, out) for out in outputs]

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


def check_request_extras(lora_request, priority) -> None:
    """vLLM's per-request arguments checked: a LoRARequest or None, and priority 0 (no priority
    scheduling here: a clear error, never a silent default)."""
    from spmd_engine.lora_request import LoRARequest
    if lora_request is not None and not isinstance(lora_request, LoRARequest):
        raise TypeError(f"lora_request must be a LoRARequest or None, got {type(lora_request).__name__}")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"priority must be an integer, got {priority!r}")
    if priority != 0:
        raise ValueError(f"Got priority {priority} but Priority scheduling is not enabled "
                         f"(spmd_engine schedules first come, first served)")


def checked_weights(shapes: dict[str, tuple[int, ...]], architecture: str, weights) -> list[tuple[str, Any]]:
    """The (HF name, full tensor) pairs as a list, each name and shape (`shapes`: the model's
    full ones) checked, so a bad one is a ValueError before any worker sees it (a worker's
    exception would fail an mp executor)."""
    from collections.abc import Mapping

    from spmd_engine.model.weights import is_skipped_name
    pairs = list(weights.items() if isinstance(weights, Mapping) else weights)
    for pair in pairs:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)):
            raise ValueError(f"load_weights expects (name, tensor) pairs, got {type(pair).__name__}")
        name, tensor = pair
        if is_skipped_name(name):
            continue
        if name not in shapes:
            raise ValueError(f"load_weights: unknown weight name {name!r} (not a tensor of this "
                             f"{architecture} model)")
        if tuple(getattr(tensor, "shape", ())) != shapes[name]:
            raise ValueError(f"load_weights: {name} has shape {list(getattr(tensor, 'shape', ()))}, "
                             f"expected {list(shapes[name])}")
    return pairs


def _light(lora_request):
    """The request's adapter without the tensors a trainer may have attached (they were loaded
    already; requests are exchanged between ranks and kept until they finish)."""
    if lora_request is None or getattr(lora_request, "lora_tensors", None) is None:
        return lora_request
    from spmd_engine.lora_request import LoRARequest
    return LoRARequest(lora_request.lora_name, lora_request.lora_int_id, lora_request.lora_path,
                       lora_request.base_model_name)
