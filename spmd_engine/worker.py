"""One rank: its device, its groups, its shard of the model, its part of each step.

A Worker is driven by name through `collective_rpc`, identically by every
executor: in-process (uni, external_launcher) or in a spawned process (mp).
Only the last pipeline stage samples; under external_launcher the sampled
tokens are then broadcast along the PP group so every rank of the replica
updates its scheduler identically.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from spmd_engine import topology
from spmd_engine.config import EngineConfig
from spmd_engine.engine.request import (
    EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput, SchedulerOutput,
)
from spmd_engine.sampler import Sampler

logger = logging.getLogger("spmd_engine")

KV_MEMORY_FRACTION = 0.4  # of free host memory (CPU) or free device memory (CUDA)


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
        self.model = None
        self.sampler = Sampler()
        self._pending: tuple[list[str], torch.Tensor] | None = None
        # Wall-clock marks (time.time()) of start-up phases, for benchmarks: get_timings().
        self.timings: dict[str, float] = {"worker_created": time.time()}

    # -- start-up ---------------------------------------------------------
    def init_device(self) -> None:
        """Pick this rank's device from its coordinate, then join every group."""
        pc = self.config.parallel_config
        if self.config.device == "cuda":
            if pc.distributed_executor_backend == "external_launcher":
                index = int(os.environ.get("LOCAL_RANK", self.local_rank))
            else:
                layout = topology.Layout(tp=pc.tensor_parallel_size, pp=pc.pipeline_parallel_size,
                                         pcp=pc.prefill_context_parallel_size)
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
            get_pp_group, get_tp_group, get_world_group, init_distributed_environment,
            initialize_model_parallel,
        )
        pc = self.config.parallel_config
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if pc.distributed_executor_backend == "external_launcher":
            init_distributed_environment(backend=backend, timeout_s=self.config.timeout_s)
            initialize_model_parallel(pc)
        else:
            # uni and mp: this replica is its own world of TP x PP x PCP ranks, which
            # initialize_model_parallel lays out as one DP replica.
            self._init_replica_world(backend)
            initialize_model_parallel(pc)
        self.world_group = get_world_group()
        self.tp_group = get_tp_group()
        self.pp_group = get_pp_group()

    def _init_replica_world(self, backend: str) -> None:
        import datetime

        import torch.distributed as dist

        from spmd_engine.distributed import init_distributed_environment
        pc = self.config.parallel_config
        timeout = datetime.timedelta(seconds=self.config.timeout_s)
        if pc.world_size == 1 and self.distributed_init_method is None:
            store = dist.HashStore()
        else:
            host, port = self.distributed_init_method.removeprefix("tcp://").rsplit(":", 1)
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=self.local_rank,
                                world_size=pc.world_size, timeout=timeout)
        self._owns_default_group = True
        init_distributed_environment(backend=backend, timeout_s=self.config.timeout_s)

    def load_model(self) -> None:
        from spmd_engine.model.loader import load_model
        from spmd_engine.model.packed_weights import pack_linear_weights, packing_applies
        mc = self.config.model_config
        self.timings["load_start"] = time.time()
        self.model = load_model(mc.model_dir, self.tp_group, self.pp_group, dtype=mc.dtype,
                                device=self.device, pp_partition=mc.pp_partition)
        if packing_applies(self.model.dtype, self.device):
            packed = pack_linear_weights(self.model, batch_hint=self.config.scheduler_config.max_num_seqs)
            logger.debug("rank %d: %d linear weights packed for oneDNN", self.rank, packed)
        self.timings["load_done"] = time.time()
        logger.debug("rank %d: weights loaded in %.3fs", self.rank,
                     self.timings["load_done"] - self.timings["load_start"])

    def determine_num_kv_slots(self, max_num_seqs: int, max_model_len: int) -> int:
        """How many sequences' KV cache fit here; the minimum over the whole world."""
        per_slot = self.model.kv_cache_bytes(1, max_model_len)
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
        else:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            free //= max(1, int(os.environ.get("LOCAL_WORLD_SIZE", self.config.parallel_config.world_size)))
        fits = int(free * KV_MEMORY_FRACTION) // max(1, per_slot)
        slots = torch.tensor([min(max_num_seqs, fits)], dtype=torch.int64)
        import torch.distributed as dist
        dist.all_reduce(slots, op=dist.ReduceOp.MIN, group=self.world_group.cpu_group)
        agreed = int(slots.item())
        if agreed < 1:
            raise RuntimeError(
                f"no room for one sequence's KV cache: max_model_len {max_model_len} needs "
                f"{per_slot} bytes per sequence on each rank; lower --max-model-len"
            )
        return agreed

    def initialize_kv_cache(self, num_slots: int, max_model_len: int) -> None:
        self.model.allocate_kv_cache(num_slots, max_model_len)

    # -- every step -------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run this rank's stage. None means: ask sample_tokens for the result."""
        for rid in out.finished_request_ids:
            self.sampler.remove_request(rid)
        for new in out.new_requests:
            self.sampler.add_request(new.request_id, new.params, new.seed)
        if not out.seqs:
            return EMPTY_MODEL_RUNNER_OUTPUT
        input_ids, positions, attn, last_index = self._prepare_inputs(out)
        intermediate = None
        if not self.pp_group.is_first_rank:
            intermediate = self.pp_group.recv_tensor_dict()
        hidden = self.model.forward(input_ids if self.pp_group.is_first_rank else None,
                                    positions, attn, intermediate)
        if not self.pp_group.is_last_rank:
            self.pp_group.send_tensor_dict(hidden)
            self._pending = ([s.request_id for s in out.seqs], None)
            return None
        rows = hidden["hidden_states"][torch.arange(len(out.seqs)), last_index]
        self._pending = ([s.request_id for s in out.seqs], self.model.compute_logits(rows))
        return None

    def _prepare_inputs(self, out: SchedulerOutput):
        from spmd_engine.model.attention import AttentionMetadata
        seqs = out.seqs
        lens = [len(s.token_ids) for s in seqs]
        width = max(lens)
        # One tensor construction per field (right-padded with 0), no per-row tensor or copy.
        rows = [s.token_ids if n == width else s.token_ids + [0] * (width - n) for s, n in zip(seqs, lens)]
        ids = torch.tensor(rows, dtype=torch.long)
        meta = torch.tensor([[s.context_len for s in seqs], [s.slot for s in seqs], lens], dtype=torch.long)
        context, slots, query_lens = meta.to(self.device).unbind(0)
        positions = context[:, None] + torch.arange(width, device=self.device)[None, :]
        attn = AttentionMetadata(slots=slots, context_lens=context, query_lens=query_lens)
        last_index = query_lens - 1
        return ids.to(self.device), positions, attn, last_index

    @torch.inference_mode()
    def sample_tokens(self, grammar_output=None) -> ModelRunnerOutput | None:
        if self._pending is None:
            return None
        request_ids, logits = self._pending
        self._pending = None
        result = None
        if self.pp_group.is_last_rank:
            tokens, logprobs = self.sampler.sample(request_ids, logits.float().cpu())
            result = ModelRunnerOutput(request_ids, tokens, logprobs)
        if self.broadcast_sampled_tokens and self.pp_group.world_size > 1:
            result = self.pp_group.broadcast_object(result, src=self.pp_group.world_size - 1)
        return result

    # -- housekeeping ------------------------------------------------------
    def check_health(self) -> bool:
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
        self.model = None
        destroy_distributed_environment()  # the model-parallel groups first, then ours
        if getattr(self, "_owns_default_group", False):
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
            self._owns_default_group = False


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

