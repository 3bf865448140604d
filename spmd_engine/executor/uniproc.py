"""Executors whose one worker lives in the engine's own process.

UniProcExecutor is the whole design at its smallest size (TP = PP = DP = 1):
collective_rpc is a plain call. ExecutorWithExternalLauncher is the same shape
in every process torchrun started: the launcher made the processes, distributed
init comes from `env://`, and every rank of a replica schedules identically.
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
        return [run_method(self.driver_worker, method, args, kwargs)]

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
