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
from spmd_engine.worker import Worker


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
        from spmd_engine.distributed.launch_env import read_launch_env
        if read_launch_env(os.environ) is None:
            import torch.distributed as dist
            if not dist.is_initialized():
                raise ConfigError(
                    "distributed_executor_backend 'external_launcher' needs a launcher: "
                    "run under torchrun or srun"
                )
        rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
        local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))
        return Worker(self.config, local_rank=local_rank, rank=rank, broadcast_sampled_tokens=True)
