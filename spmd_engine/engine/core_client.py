"""EngineCoreClient: the front end's one way to reach the engine cores it drives.

`LLM` drives either one EngineCore in its own process (uni, mp with DP = 1,
external_launcher) or one EngineCore_DP{i} process per replica (dp_client.py).
Both answer the same calls, each per replica in replica order, so the front end
never asks which kind it holds. The front end (engine/llm_engine.py) drives them
step by step: add_request, step (the requests that made progress), abort_requests.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

from spmd_engine.config import EngineConfig
from spmd_engine.core.request import Request

# on_finished(requests): these requests just finished (a step's, or a replica's message).
FinishedCallback = Callable[[list[Request]], None]


class EngineDeadError(RuntimeError):
    """The executor failed; every in-flight request of this engine fails with it.

    `finished` holds the requests that had finished before the failure (DP replicas stream
    theirs); the front end sets `partial_outputs`: per prompt, its RequestOutput when all
    its samples had finished, else None.
    """

    def __init__(self, message: str, finished: list[Request] | None = None):
        super().__init__(message)
        self.finished: list[Request] = list(finished or [])
        self.partial_outputs: list | None = None


class EngineCoreClient(ABC):
    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue the request in one replica (spread over the replicas in the order added)."""

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        """Finish these requests (finish_reason "abort"); those that were unfinished."""

    @abstractmethod
    def step(self) -> list[Request]:
        """One step of every replica with work: the requests that made progress."""

    @abstractmethod
    def has_unfinished_requests(self) -> bool:
        """Some replica has work (with DP waves: or its wave is still open)."""

    @abstractmethod
    def drain(self) -> list[Request]:
        """Finish the steps in flight everywhere; the requests that made progress."""

    @abstractmethod
    def call_core(self, method: str, *args) -> list:
        """`EngineCore.method(*args)` in every replica, one reply each."""

    @abstractmethod
    def collective_rpc(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None,
                       unique_reply_rank: int | None = None) -> list[Any]:
        """A Worker method on every worker of every replica (replies in replica order)."""

    @property
    @abstractmethod
    def vllm_config(self) -> EngineConfig:
        """The engines' configuration, with the KV block count their workers agreed on."""

    @property
    @abstractmethod
    def llm_engine(self):
        """What `LLM.llm_engine` shows (vLLM's name): the EngineCore when it lives here."""

    @abstractmethod
    def shutdown(self) -> None:
        """End every replica and its workers; safe to call twice."""


class InProcClient(EngineCoreClient):
    """One EngineCore in this process."""

    def __init__(self, engine_core):
        self.engine_core = engine_core

    def add_request(self, request: Request) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        return self.engine_core.abort_requests(request_ids)

    def step(self) -> list[Request]:
        return self.engine_core.step()

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def drain(self) -> list[Request]:
        return self.engine_core.drain()

    def call_core(self, method: str, *args) -> list:
        return [getattr(self.engine_core, method)(*args)]

    def collective_rpc(self, method, args=(), kwargs=None, unique_reply_rank=None) -> list[Any]:
        return self.engine_core.collective_rpc(method, args, kwargs, unique_reply_rank)

    @property
    def vllm_config(self) -> EngineConfig:
        return self.engine_core.vllm_config

    @property
    def llm_engine(self):
        return self.engine_core

    def shutdown(self) -> None:
        self.engine_core.shutdown()


def make_client(config: EngineConfig, inputs) -> EngineCoreClient:
    """One EngineCore in this process (uni, mp at DP = 1, external_launcher) or one
    EngineCore_DP{i} process per replica (DP > 1)."""
    from spmd_engine.executor.abstract import Executor
    pc = config.parallel_config
    executor_class = Executor.get_class(config)
    if pc.distributed_executor_backend == "external_launcher" or pc.data_parallel_size == 1:
        from spmd_engine.engine.core import EngineCore
        return InProcClient(EngineCore(config, executor_class, inputs.max_model_len, inputs.eos_token_ids))
    from spmd_engine.engine.dp_client import DPEngineClient
    return DPEngineClient(config, executor_class, inputs.max_model_len, inputs.eos_token_ids)
