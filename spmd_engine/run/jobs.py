"""The two ways a run goes: launched (torchrun / srun: every rank runs this, each replica
generates its share and global rank 0 writes the result once) or local (one LLM drives
its own processes). Both stream to part files with --output, so a job can resume."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from spmd_engine import topology
from spmd_engine.config import ConfigError
from spmd_engine.run.gather import gather_records
from spmd_engine.run.output_parts import PartWriter, index_parts, job_identity, merge_parts, restarted
from spmd_engine.run.progress import Progress, progress_wanted
from spmd_engine.run.records import generate_records

if TYPE_CHECKING:
    from spmd_engine.engine.arg_utils import EngineSetup

logger = logging.getLogger("spmd_engine")


def check_launched_world(setup: "EngineSetup") -> None:
    """The launcher's world must hold whole replicas, and rank 0's rendezvous port must be free:
    fail before any rendezvous."""
    from spmd_engine.distributed.launch_env import read_launch_env
    from spmd_engine.distributed.master_port import check_master_port
    launch = read_launch_env(os.environ)
    if launch is not None:
        try:
            topology.Layout.of(setup.config.parallel_config, launch.world_size)
        except topology.TopologyError as exc:
            var = "WORLD_SIZE" if launch.source == "torchrun" else "SLURM_NTASKS"
            raise topology.TopologyError(f"{exc} ({var} of this {launch.source} launch)") from None
        check_master_port(launch, os.environ)


def check_same_invocation(args, inputs) -> None:
    """Every rank must have the same flags and inputs (a job's key()); compare a hash through the
    launcher's store before any group or model exists, and fail on every rank.

    Rank 0 alone reads every rank's hash and publishes the verdict; the others read
    only that, so the check costs O(world) store operations in all, not O(world^2).
    """
    import hashlib

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store
    digest = hashlib.sha256(repr((sorted(vars(args).items()), inputs)).encode()).hexdigest()
    store, rank, world = _get_default_store(), dist.get_rank(), dist.get_world_size()
    verdict_key = "spmd_engine/invocation/verdict"
    if rank == 0:
        others = [digest] + [store.get(f"spmd_engine/invocation/{r}").decode() for r in range(1, world)]
        odd = [r for r, d in enumerate(others) if d != digest]
        store.set(verdict_key, repr(odd))
    else:
        store.set(f"spmd_engine/invocation/{rank}", digest)
        odd = _parse_rank_list(store.get(verdict_key).decode())
    if odd:
        raise ConfigError(f"ranks {odd} were started with different flags or prompts than rank 0")


def _parse_rank_list(text: str) -> list[int]:
    """The verdict rank 0 wrote: a list of ints, parsed without eval."""
    import ast
    return [int(r) for r in ast.literal_eval(text)]


def log_launch(llm) -> None:
    """One line per rank: where the launcher put it and the device it got (local rank = device)."""
    from spmd_engine.distributed.launch_env import read_launch_env
    env = read_launch_env(os.environ)
    if env is None:  # a default group made by someone else
        return
    try:
        device = llm.collective_rpc(lambda worker: str(worker.device))[0]
    except Exception:  # noqa: BLE001 - the line is informative only
        device = "?"
    logger.info("launch: source=%s rank=%d world=%d node=%d local_rank=%d local_world=%d device=%s backend=%s",
                env.source, env.rank, env.world_size, env.node_rank, env.local_rank, env.local_world_size,
                device, llm.config.parallel_config.distributed_executor_backend)


def log_engine_stats(llm, first_replica: int = 0) -> None:
    """One line per replica: steps, preemptions, prefix-cache hits, prompt tokens computed."""
    for i, s in enumerate(llm.get_stats()):
        logger.info("engine stats (replica %d): steps=%d preemptions=%d peak_running=%d "
                    "prefix_hits_tokens=%d/%d prefill_tokens=%d kv_blocks=%d", first_replica + i, s["steps"],
                    s["preemptions"], s["peak_running"], s["prefix_hits_tokens"], s["prefix_queries_tokens"],
                    s["runner"]["prefill_tokens"], s["num_blocks"])
        if s.get("dp_waves"):
            logger.info("engine stats (replica %d): DP waves=%d wave_steps=%d dummy_steps=%d",
                        first_replica + i, s["waves"], s["wave_steps"], s["dummy_steps"])


def run_launched(args, setup, job, todo: list[int], ident: dict | None) -> list[dict] | None:
    """Under torchrun/srun: this replica's share of `todo`, streamed to its part file (with
    --output) and merged by global rank 0, or gathered to global rank 0 and returned."""
    from spmd_engine.distributed import init_distributed_environment
    init_distributed_environment(timeout_s=args.timeout)
    check_same_invocation(args, job.key())
    from spmd_engine.engine.llm import LLM
    llm = LLM.from_engine_setup(setup)
    try:
        from spmd_engine.distributed import get_world_group
        log_launch(llm)
        world = get_world_group()
        pc = llm.config.parallel_config
        layout = topology.Layout.of(pc, world.world_size)
        replica = llm.replica_index
        indices = todo[replica::layout.num_replicas]
        progress = None
        if progress_wanted(args):
            label = f" (replica 0 of {layout.num_replicas})" if layout.num_replicas > 1 else ""
            progress = Progress(len(indices), label)
        is_head = world.rank % layout.world_size == 0
        heads = list(range(0, world.world_size, layout.world_size))
        if args.output is None:
            records = generate_records(llm, job, indices, progress=progress)
            if is_head:
                log_engine_stats(llm, first_replica=replica)
            return gather_records(records, world.rank, is_head, heads)
        writer = PartWriter(args.output, ident, replica) if is_head else None
        try:
            generate_records(llm, job, indices, progress=progress, sink=writer)
        finally:
            if writer is not None:
                writer.close()
        if is_head:
            log_engine_stats(llm, first_replica=replica)
        gather_records([], world.rank, is_head, heads)  # every part is complete: rank 0 merges
        if world.rank == 0:
            merge_parts(args.output, ident, len(job), drop_index=job.drop_index)
        return None
    finally:
        llm.shutdown()


def run_local(args, setup, job, todo: list[int], ident: dict | None) -> list[dict] | None:
    from spmd_engine.engine.llm import LLM
    llm = LLM.from_engine_setup(setup)
    try:
        progress = Progress(len(todo)) if progress_wanted(args) else None
        if args.output is None:
            records = generate_records(llm, job, todo, progress=progress)
            log_engine_stats(llm)
            return records
        writer = PartWriter(args.output, ident, 0)
        try:
            generate_records(llm, job, todo, progress=progress, sink=writer)
        finally:
            writer.close()
        log_engine_stats(llm)
    finally:
        llm.shutdown()
    merge_parts(args.output, ident, len(job), drop_index=job.drop_index)
    return None


def prompts_to_do(args, job) -> tuple[list[int], dict | None]:
    """Which of the job's inputs this run generates: all, or (resuming) those no part file holds yet.

    Every rank reads the parts before any group exists, and no writer opens its part
    before the groups are built (a world-wide collective), so every rank sees the same.
    """
    if args.output is None:
        if args.resume:
            raise ConfigError("--resume needs --output: it continues that file's part files")
        return list(range(len(job))), None
    ident = job_identity(args, job)
    index = index_parts(args.output, ident)
    if not index.parts:
        return list(range(len(job))), ident
    why = "--resume" if args.resume else restarted()
    if why is None:
        raise ConfigError(f"--output {args.output}: {len(index.parts)} part files of an interrupted run "
                          f"are there ({len(index.locations)} records); pass --resume to continue it, "
                          f"or delete {args.output}.part-*")
    todo = [i for i in range(len(job)) if i not in index.locations]
    logger.info("resuming (%s): %d of %d prompts done in %d part files, %d to go", why,
                len(index.locations), len(job), len(index.parts), len(todo))
    return todo, ident
