"""Executors whose one worker lives in the engine's own process.

UniProcExecutor is the whole design at its smallest size (TP = PP = DP = 1):
collective_rpc is a plain call. ExecutorWithExternalLauncher is the same shape
in every process torchrun started: the launcher made the processes, distributed
init comes from `env://`, and every rank of a replica schedules identically.

A step that raises leaves the worker's state unknown (a forward stopped halfway, a
sampler that advanced or not), so the executor fails: every later call raises, as
the mp executor's do after a worker error, instead of running on that state.

Steps run in the caller's thread, also under async scheduling (the engine's host
work moves to a thread of its own instead, engine/overlapped_steps.py): torch's
OpenMP runtime slows every parallel region of the process once a second thread runs
them beside the first on a machine with as many threads as cores.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from spmd_engine.config import ConfigError
from spmd_engine.executor.abstract import Executor, run_method
from spmd_engine.worker.worker import Worker


class UniProcExecutor(Executor):
    broadcast_sampled_tokens = False

    def _init_executor(self) -> None:
        self.driver_worker = self._make_worker()
        self._shut = False
        self._failure: str | None = None  # the step that raised, once one has
        try:
            self.driver_worker.init_device()
            self.driver_worker.load_model()
        except BaseException:
            self.driver_worker.shutdown()
            raise

    def _make_worker(self) -> Worker:
        import torch.distributed as dist
        if dist.is_initialized():  # a process has one default group, and this one is the caller's
            raise ConfigError(
                "torch.distributed's default process group already exists (made by the caller): an "
                "engine in this process can only share it, with distributed_executor_backend="
                "'external_launcher' (one replica per TP x PP ranks of that world)"
            )
        pc = self.parallel_config  # with DP > 1 this replica's rank in the one world across DP
        return Worker(self.config, local_rank=0, rank=pc.data_parallel_rank if pc.spans_dp_world else 0,
                      dp_local_rank=pc.data_parallel_rank_local or 0)

    def collective_rpc(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None,
                       unique_reply_rank: int | None = None, timeout: float | None = None) -> list[Any]:
        self._check_not_failed()
        return [run_method(self.driver_worker, method, args, kwargs)]

    @property
    def runs_steps_in_caller(self) -> bool:
        return True

    def execute_model_async(self, scheduler_output) -> Callable[[], Any]:
        output = self._run_step(scheduler_output)
        return lambda: output

    def _run_step(self, scheduler_output):
        self._check_not_failed()
        try:
            return self.driver_worker.execute_and_sample(scheduler_output)
        except BaseException as exc:
            self.is_failed = True
            self._failure = f"step {scheduler_output.step} raised {type(exc).__name__}: {exc}"
            raise

    def _check_not_failed(self) -> None:
        if self.is_failed:
            raise RuntimeError(f"Executor failed. ({self._failure})")

    def shutdown(self) -> None:
        if not self._shut:
            self._shut = True
            self.driver_worker.shutdown()


class ExecutorWithExternalLauncher(UniProcExecutor):
    """One engine per torchrun process; all ranks of a replica run the same schedule."""

    def _make_worker(self) -> Worker:
        """This process's place: the trainer's default group when one exists (its world may have
        been made from tcp:// or file:// with no launcher variables at all), else the launch env."""
        import torch
        import torch.distributed as dist

        from spmd_engine.distributed.launch_env import read_launch_env
        launch = read_launch_env(os.environ)
        if dist.is_initialized():
            rank = dist.get_rank()
        elif launch is not None:
            rank = launch.rank
        else:
            raise ConfigError(
                "distributed_executor_backend 'external_launcher' needs a launcher (torchrun, srun) "
                "or a default process group made by the caller (torch.distributed.init_process_group)"
            )
        if launch is not None:
            local_rank = launch.local_rank
        else:  # a trainer that built its world by hand has already picked its device
            local_rank = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return Worker(self.config, local_rank=local_rank, rank=rank, broadcast_sampled_tokens=True)
