"""One rank: its device, its groups, and the RPC surface the executors call.

A Worker is driven by name through `collective_rpc`, identically by every
executor: in-process (uni, external_launcher) or in a spawned process (mp).
What happens each step (inputs, KV cache, forward, sampling) is its
ModelRunner's. Only the last pipeline stage samples; under external_launcher
the sampled tokens are then broadcast along the PP group so every rank of the
replica updates its scheduler identically.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from spmd_engine import topology
from spmd_engine.config import EngineConfig
from spmd_engine.core.step_messages import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("spmd_engine")


class Worker:
    def __init__(self, config: EngineConfig, local_rank: int = 0, rank: int = 0,
                 distributed_init_method: str | None = None, dp_local_rank: int = 0,
                 broadcast_sampled_tokens: bool = False):
        self.config = config
        self.local_rank = local_rank
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.dp_local_rank = dp_local_rank
        self.broadcast_sampled_tokens = broadcast_sampled_tokens
        self.device = torch.device("cpu")
        self.model_runner = None
        # Wall-clock marks (time.time()) of start-up phases, for benchmarks: get_timings().
        self.timings: dict[str, float] = {"worker_created": time.time()}

    # -- start-up ---------------------------------------------------------
    def init_device(self) -> None:
        """Pick this rank's device from its coordinate, then join every group."""
        pc = self.config.parallel_config
        if self.config.device == "cuda":
            if pc.distributed_executor_backend == "external_launcher":
                index = self.local_rank
            else:
                layout = pc.layout
                index = topology.device_index_mp(layout, self.local_rank, self.dp_local_rank)
            self.device = torch.device(f"cuda:{index}")
            torch.cuda.set_device(self.device)
        self.timings["init_device_start"] = time.time()
        self._init_groups()
        self.timings["groups_created"] = time.time()
        logger.debug("rank %d: process groups created in %.3fs", self.rank,
                     self.timings["groups_created"] - self.timings["init_device_start"])

    def _init_groups(self) -> None:
        from spmd_engine.distributed import (
            get_dp_group,
            get_pp_group,
            get_tp_group,
            get_world_group,
            init_distributed_environment,
            initialize_model_parallel,
        )
        pc = self.config.parallel_config
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if pc.distributed_executor_backend == "external_launcher":
            init_distributed_environment(local_rank=self.local_rank, backend=backend,
                                         timeout_s=self.config.timeout_s)
            initialize_model_parallel(pc, dp_waves=self.config.dp_waves)
        else:
            # uni and mp: the engine's own world, laid out by initialize_model_parallel.
            self._init_engine_world(backend)
            initialize_model_parallel(pc, dp_waves=self.config.dp_waves)
        self.world_group = get_world_group()
        self.tp_group = get_tp_group()
        self.pp_group = get_pp_group()
        self.dp_group = get_dp_group()
        self.moe_groups = self._moe_groups()

    def _moe_groups(self) -> dict:
        """How MoE layers shard their experts (a dense model ignores it), as vLLM: with expert
        parallelism whole experts over the EP group; without it each expert's width over TP,
        or, when the replicas step together in DP waves (a MoE under DP), over the flattened
        DP x TP ranks (the EP-shaped group). Across replicas tokens are gathered over the DP
        group (moe.py)."""
        from spmd_engine.distributed import get_ep_group
        from spmd_engine.model.partition import moe_sharding
        axis, expert_parallel = moe_sharding(self.config.parallel_config, self.config.dp_waves)
        if axis == "tp":
            return {"moe_group": self.tp_group, "expert_parallel": False}
        return {"moe_group": get_ep_group(), "expert_parallel": expert_parallel, "dispatch_group": self.dp_group}

    def _init_engine_world(self, backend: str) -> None:
        """Join the torch world of engine-spawned workers.

        DP = 1: this replica's TP x PP x PCP workers, meeting at their executor's store.
        DP > 1: every replica's workers in one world of world_size_across_dp ranks (vLLM's
        layout), meeting at the store the front end hosts; `self.rank` is the global rank
        dp * world_size + local rank, so the DP and EP groups are the ones `plan` prints.
        """
        import datetime

        import torch.distributed as dist

        from spmd_engine.distributed import init_distributed_environment
        pc = self.config.parallel_config
        timeout = datetime.timedelta(seconds=self.config.timeout_s)
        world = pc.world_size_across_dp if pc.spans_dp_world else pc.world_size
        if pc.spans_dp_world:
            if not pc.data_parallel_master_port:
                raise RuntimeError("DP > 1 without a launcher needs the front end's rendezvous "
                                   "(data_parallel_master_port is not set)")
            store = dist.TCPStore(pc.data_parallel_master_ip, pc.data_parallel_master_port,
                                  is_master=False, timeout=timeout)
        elif world == 1 and self.distributed_init_method is None:
            store = dist.HashStore()
        else:
            host, port = self.distributed_init_method.removeprefix("tcp://").rsplit(":", 1)
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=world, timeout=timeout)
        self._owns_default_group = True
        init_distributed_environment(backend=backend, timeout_s=self.config.timeout_s)

    def load_model(self) -> None:
        from spmd_engine.worker.model_runner import ModelRunner
        self.timings["load_start"] = time.time()
        self.model_runner = ModelRunner(self.config, self.device, self.tp_group, self.pp_group,
                                        moe_groups=self.moe_groups,
                                        broadcast_sampled_tokens=self.broadcast_sampled_tokens)
        self.model_runner.load_model()
        self.timings["load_done"] = time.time()
        logger.debug("rank %d: weights loaded in %.3fs", self.rank,
                     self.timings["load_done"] - self.timings["load_start"])

    @property
    def model(self):
        return self.model_runner.model if self.model_runner is not None else None

    def get_model(self):
        """vLLM's driver_worker.get_model(): this rank's model (torchtitan and verl load weights
        through it)."""
        return self.model

    def apply_model(self, func):
        """vLLM's LLM.apply_model: func(this rank's model)."""
        return func(self.model)

    @property
    def worker(self) -> "Worker":
        """Itself: trainers reach the model as `driver_worker.worker.model_runner.model` (vLLM's
        driver worker is a wrapper whose `.worker` is the Worker)."""
        return self

    # -- weights (RL trainers) ---------------------------------------------------
    def load_weights(self, weights) -> set[str]:
        """Copy (HF name, full tensor) pairs into this rank's shard; returns the names it used."""
        return self.model_runner.load_weights(weights)

    def reload_weights(self) -> set[str]:
        """Read this rank's weights from the model directory on disk again."""
        return self.model_runner.reload_weights()

    def start_weight_update(self) -> None:
        """LLM.start_weight_update: watch this rank's loads until finish_weight_update."""
        self.model_runner.model.begin_update()

    def finish_weight_update(self) -> str | None:
        """Why this rank cannot serve the update just closed (a failed load, tensors left
        out), or None; see CausalLMWeights.end_update."""
        problem = self.model_runner.model.end_update()
        return None if problem is None else f"rank {self.rank}: {problem}"

    def mark_weights_mixed(self) -> None:
        """Another rank's update failed: this rank's tensors must all be written again too."""
        self.model_runner.model.mark_weights_mixed()

    # -- weight transfer from a trainer job (worker/weight_transfer.py; vLLM's names) -------
    @property
    def _transfer(self):
        if getattr(self, "_weight_transfer", None) is None:
            from spmd_engine.worker.weight_transfer import WorkerWeightTransfer
            self._weight_transfer = WorkerWeightTransfer()
        return self._weight_transfer

    def init_weight_transfer_engine(self, init_info: dict) -> str | None:
        """Join the trainer's transfer group; the reason it failed, else None."""
        return self._transfer.init(self, init_info)

    def update_weights(self, update_info: dict | None = None) -> str | None:
        """Receive one update from the trainer into this rank's shard; the reason it failed, else None."""
        return self._transfer.update(self, update_info)

    def shutdown_weight_transfer_engine(self) -> None:
        self._transfer.shutdown()

    # -- LoRA adapters (engine/lora_adapters.py decides, every rank alike) ------------------
    def add_lora(self, source, replace: bool = False) -> str | None:
        """Load this rank's shard of an adapter; the reason it failed, else None (returned, not
        raised: the engine drops it everywhere and keeps serving the others)."""
        try:
            self.model_runner.add_lora(source, replace)
        except ValueError as exc:
            return f"rank {self.rank}: {exc}"
        return None

    def remove_lora(self, lora_id: int) -> bool:
        return self.model_runner.remove_lora(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        return self.model_runner.pin_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.model_runner.list_loras()

    def determine_num_kv_blocks(self) -> tuple[int, int]:
        """(blocks, bytes per token): this rank's budget in blocks, the minimum over the world."""
        import torch.distributed as dist

        from spmd_engine.core import kv_sizing
        runner = self.model_runner
        per_token = runner.model.kv_bytes_per_token()
        budget = runner.kv_budget_bytes()
        sc = self.config.scheduler_config
        if runner.kv_windows:  # several KV groups: the full group's count, each group sized (core/kv_groups.py)
            from spmd_engine.core import kv_groups
            mine = kv_groups.num_blocks_for(budget, runner.block_size, kv_groups.bytes_by_window(runner.model), sc)
        else:
            mine = kv_sizing.num_blocks_for(budget, runner.block_size, per_token)
        blocks = torch.tensor([mine], dtype=torch.int64)
        dist.all_reduce(blocks, op=dist.ReduceOp.MIN, group=self.world_group.cpu_group)
        agreed = int(blocks.item())
        from spmd_engine.model.windows import kv_freeing_window
        kv_sizing.check_fits(agreed, runner.block_size, sc.max_model_len, per_token, budget,
                             kv_freeing_window(runner.model.spec.layer_windows, self.config.model_config), sc.max_num_batched_tokens)
        return agreed, per_token

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    # -- every step (the runner's) -------------------------------------------------
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.model_runner.execute_model(out)

    def sample_tokens(self) -> ModelRunnerOutput | None:
        return self.model_runner.sample_tokens()

    # -- DP waves (engine/dp_waves.py) --------------------------------------------------
    @torch.inference_mode()  # the DP group's shared-memory buffers are made inside the forward's
    def dp_any_unfinished(self, local_unfinished: bool) -> bool:
        """Whether any DP replica still has work: a sum over this rank's DP group (its CPU
        path). Every rank of a replica passes the same flag, so all DP groups agree."""
        flag = torch.tensor([int(local_unfinished)], dtype=torch.int64)
        return bool(self.dp_group.all_reduce(flag).item())

    def execute_dummy_batch(self) -> None:
        self.model_runner.execute_dummy_batch()

    def execute_and_sample(self, out: SchedulerOutput) -> ModelRunnerOutput | None:
        """One message per step for an engine with steps in flight: run, then sample."""
        result = self.model_runner.execute_model(out)
        return result if result is not None else self.model_runner.sample_tokens()

    def get_runner_stats(self) -> dict:
        return self.model_runner.get_stats()

    # -- sleep mode (LLM.sleep / wake_up) ----------------------------------------------
    def sleep(self, level: int = 1) -> dict:
        """Give this rank's KV cache (level 1) and weights (level 2) back; report the memory."""
        before = self.memory_usage()
        self.model_runner.sleep(level)
        _release_free_heap()
        after = self.memory_usage()
        report = {"rank": self.rank, "pid": os.getpid(), "rss_before": before["rss_bytes"],
                  "rss_after": after["rss_bytes"], "freed_bytes": before["rss_bytes"] - after["rss_bytes"]}
        if self.device.type == "cuda":
            report["device_freed_bytes"] = after["device_free_bytes"] - before["device_free_bytes"]
        return report

    def wake_up(self, tags: list[str]) -> None:
        self.model_runner.wake_up(tags)

    def weights_need_load(self) -> bool:
        """True after sleep(level=2) until load_weights / reload_weights filled every tensor."""
        return self.model_runner.model.needs_weights

    def unwritten_weights(self) -> list[str]:
        """HF names of this rank's tensors with no value since sleep(level=2) discarded them."""
        return self.model_runner.model.unwritten_weights()

    def weights_loaded_since_discard(self) -> bool:
        return not self.model_runner.model.reload_pending

    def memory_usage(self) -> dict:
        """This process's resident memory (from /proc/self/statm) and, on CUDA, the device's free bytes."""
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        out = {"rss_bytes": rss, "pid": os.getpid()}
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            out["device_free_bytes"] = torch.cuda.mem_get_info(self.device)[0]
        return out

    # -- housekeeping ------------------------------------------------------
    def check_health(self) -> bool:
        """vLLM's name for the cheapest call: a live worker answers True (benchmarks time the
        RPC transport with it)."""
        return True

    def get_timings(self) -> dict[str, float]:
        """Start-up marks (time.time()) plus this process's start time and peak RSS (bytes)."""
        import resource
        out = dict(self.timings)
        out["process_start"] = _process_start_time()
        out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        out["pid"] = os.getpid()
        return out

    def shutdown(self) -> None:
        from spmd_engine.distributed import destroy_distributed_environment
        self.shutdown_weight_transfer_engine()
        self.model_runner = None
        if self.device.type == "cuda":
            # The weights, cache and graphs back to the device, not kept by torch's allocator: a
            # next engine in this process (an RL trainer's, a benchmark's) sizes its KV cache
            # from the device's free memory.
            import gc
            gc.collect()
            torch.cuda.empty_cache()
        destroy_distributed_environment()  # the model-parallel groups first, then ours
        if getattr(self, "_owns_default_group", False):
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
            self._owns_default_group = False


def _release_free_heap() -> None:
    """Hand freed heap pages back to the kernel (glibc keeps large frees below its dynamic mmap
    threshold in the heap): without it RSS would not show what sleep gave back."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _process_start_time() -> float:
    """When this process started (time.time() scale), from /proc; nan where unavailable."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration, IndexError):
        return float("nan")

