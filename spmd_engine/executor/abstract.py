"""The Executor contract: one engine's way of reaching its workers.

`get_class` runs once in the launching process, and every DP replica's engine
receives the same class. `collective_rpc` calls a Worker method (by name, or a
callable taking the worker first) on every worker of this replica and returns
the replies as a list, or only the `unique_reply_rank`'s reply as a list of one.
"""

from __future__ import annotations

import pickle
from abc import ABC, abstractmethod
from typing import Any, Callable

from spmd_engine.config import ConfigError, EngineConfig


def dumps_method(method: str | Callable) -> str | bytes:
    """A method name travels as is; a callable is pickled by cloudpickle (lambdas and closures
    too, as in vLLM). One that cannot be pickled is a TypeError naming it, raised before
    anything is sent, so the workers and the executor are untouched."""
    if isinstance(method, str):
        return method
    import cloudpickle
    try:
        return cloudpickle.dumps(method, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        name = getattr(method, "__qualname__", None) or repr(method)
        raise TypeError(f"collective_rpc: cannot send {name} to the workers: it does not pickle "
                        f"({type(exc).__name__}: {exc})") from exc


def loads_method(method: str | bytes) -> str | Callable:
    return pickle.loads(method) if isinstance(method, bytes) else method


def run_method(obj: Any, method: str | Callable, args: tuple, kwargs: dict | None) -> Any:
    """Call `obj.method(*args, **kwargs)`, or `method(obj, *args, **kwargs)` for a callable."""
    kwargs = kwargs or {}
    if isinstance(method, str):
        try:
            func = getattr(obj, method)
        except AttributeError:
            raise AttributeError(f"{type(obj).__name__} has no method {method!r}") from None
        return func(*args, **kwargs)
    return method(obj, *args, **kwargs)


class Executor(ABC):
    def __init__(self, config: EngineConfig):
        self.config = config
        self.parallel_config = config.parallel_config
        self.is_failed = False
        # What sleep gave back and wake_up has not brought back ("weights", "kv_cache"); vLLM's
        # executor.is_sleeping reads it (ms-swift checks it before each wake).
        self.sleeping_tags: set[str] = set()
        self._init_executor()

    @property
    def is_sleeping(self) -> bool:
        return bool(self.sleeping_tags)

    @staticmethod
    def get_class(config: EngineConfig) -> type["Executor"]:
        backend = config.parallel_config.distributed_executor_backend
        if isinstance(backend, type):
            if not issubclass(backend, Executor):
                raise ConfigError(
                    f"distributed_executor_backend must be a subclass of Executor, got {backend!r}"
                )
            return backend
        if backend == "mp":
            from spmd_engine.executor.multiproc import MultiprocExecutor
            return MultiprocExecutor
        if backend == "uni":
            from spmd_engine.executor.uniproc import UniProcExecutor
            return UniProcExecutor
        if backend == "external_launcher":
            from spmd_engine.executor.uniproc import ExecutorWithExternalLauncher
            return ExecutorWithExternalLauncher
        raise ConfigError(f"Unknown distributed executor backend: {backend}")

    @abstractmethod
    def _init_executor(self) -> None:
        """Start the workers, load the model."""

    @abstractmethod
    def collective_rpc(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None,
                       unique_reply_rank: int | None = None, timeout: float | None = None) -> list[Any]:
        ...

    @property
    def output_rank(self) -> int:
        """First TP worker of the last PP stage: the only reply execute_model needs."""
        return self.parallel_config.output_rank

    def execute_model(self, scheduler_output):
        return self.collective_rpc("execute_model", (scheduler_output,),
                                   unique_reply_rank=self.output_rank)[0]

    def sample_tokens(self):
        return self.collective_rpc("sample_tokens", unique_reply_rank=self.output_rank)[0]

    def dp_any_unfinished(self, local_unfinished: bool) -> bool:
        """DP waves: all-reduced over the DP group by the workers (the group plan prints)."""
        return self.collective_rpc("dp_any_unfinished", (local_unfinished,),
                                   unique_reply_rank=self.output_rank)[0]

    def execute_dummy_batch(self) -> None:
        self.collective_rpc("execute_dummy_batch", unique_reply_rank=self.output_rank)

    @property
    def max_concurrent_batches(self) -> int:
        """Steps the engine may have in flight at once (vLLM's batch queue): 2 with async
        scheduling (the next step is scheduled while one runs), else 1 unless the executor
        can run pipeline stages on different steps at the same time."""
        return 2 if self.config.scheduler_config.async_scheduling else 1

    @property
    def runs_steps_in_caller(self) -> bool:
        """The step runs in the engine's own thread (uni, external_launcher): async scheduling
        then overlaps the host's work with it from another thread (engine/overlapped_steps.py)
        instead of sending the step away."""
        return False

    def execute_model_async(self, scheduler_output) -> Callable[[], Any]:
        """Start a step; the returned function gives its ModelRunnerOutput. Here the step
        runs to the end first; executors that overlap steps return before it has."""
        output = self.execute_model(scheduler_output)
        if output is None:
            output = self.sample_tokens()
        return lambda: output

    def determine_num_kv_blocks(self) -> tuple[int, int]:
        """(blocks, KV bytes per token on the fullest rank): workers already agree on the blocks."""
        replies = self.collective_rpc("determine_num_kv_blocks")
        return min(b for b, _ in replies), max(t for _, t in replies)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))

    def shutdown(self) -> None:
        """Release workers and groups; safe to call twice."""
