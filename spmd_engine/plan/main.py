"""`python -m spmd_engine.plan`: the layout a launch will have, before spending GPU hours.

Without `--live` this is pure arithmetic and runs anywhere. With `--live`, run
under torchrun or srun: it brings every group up for real and checks, with
collectives, that each rank's groups are the ones printed here.
"""

from __future__ import annotations

import json
import os
import sys

from spmd_engine.config import ConfigError, ParallelConfig, launched_by_torchrun
from spmd_engine.plan.moe import render_moe_plan
from spmd_engine.plan.report import plan_dict, render_plan
from spmd_engine.run.cli_args import (
    EXIT_USAGE,
    UsageParser,
    add_cache_args,
    add_parallel_args,
    check_cache_args,
    parallel_config_from_args,
)
from spmd_engine.topology import Layout, TopologyError


def build_parser() -> UsageParser:
    parser = UsageParser(prog="python -m spmd_engine.plan", description=__doc__.splitlines()[0])
    add_parallel_args(parser)
    parser.add_argument("--world-size", type=int, default=None, metavar="N",
                        help="launched ranks (default: TP x PP x PCP x DP; under torchrun: WORLD_SIZE); "
                             "a multiple gives external-DP replicas")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object (ranks, groups, processes)")
    parser.add_argument("--live", action="store_true",
                        help="under torchrun/srun: build the groups and verify them with collectives")
    kv = parser.add_argument_group("KV cache budget (printed when --model is given)")
    kv.add_argument("--model", default=None, help="HF-format checkpoint directory: print its KV cache budget")
    kv.add_argument("--dtype", default=None)
    kv.add_argument("--max-model-len", type=int, default=None)
    kv.add_argument("--max-num-seqs", type=int, default=256)
    kv.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the ranks will run (cuda: give --gpu-memory for the memory plan)")
    kv.add_argument("--gpu-memory", default=None, metavar="SIZE",
                    help="each GPU's memory (80GiB, 80GB, 80e9, bytes): with --device cuda, per rank the "
                         "weights, activations, KV blocks left and a fits / does not fit verdict")
    kv.add_argument("--gpus-per-node", type=int, default=8, metavar="N",
                    help="GPUs of a node: TP stays within one (for the smallest layout that fits)")
    add_cache_args(parser)
    return parser


def layout_for(config: ParallelConfig, world_size: int | None) -> tuple[Layout, str]:
    """The launched layout and the backend that runs it.

    mp and uni start their own processes, so they cannot be handed a launched
    world beyond TP x PP x PCP x DP; only a launcher makes external-DP replicas.
    """
    backend = config.distributed_executor_backend
    if world_size is None:
        world_size = config.world_size_across_dp
    if world_size != config.world_size_across_dp and backend != "external_launcher":
        raise ConfigError(
            f"--world-size {world_size} differs from TP x PP x PCP x DP = "
            f"{config.world_size_across_dp}; external-DP replicas need "
            f"--distributed-executor-backend external_launcher"
        )
    layout = Layout.for_world(
        world_size,
        tp=config.tensor_parallel_size,
        pp=config.pipeline_parallel_size,
        pcp=config.prefill_context_parallel_size,
        dcp=config.decode_context_parallel_size,
        dp=config.data_parallel_size,
    )
    return layout, backend


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    world = args.world_size
    if world is None and launched_by_torchrun(os.environ):
        world = int(os.environ["WORLD_SIZE"])
    if world is not None and args.distributed_executor_backend is None:
        # A launched world is the launcher's: the default backend is external_launcher.
        args.distributed_executor_backend = "external_launcher"
    try:
        config = parallel_config_from_args(args)
        layout, backend = layout_for(config, world)
        check_cache_args(args)
        gpu_memory = gpu_memory_from_args(args)
        setup = engine_setup_from_args(args) if args.model else None
        kv = kv_plan_from_args(setup) if setup else None
        memory = memory_plan_from_args(args, setup, layout, gpu_memory) if setup else None
        moe = moe_plan_from_args(args, config, layout)
    except (ConfigError, TopologyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.live:
        return _live(config, layout)
    if args.json:
        plan = plan_dict(layout, backend, args.nnodes)
        if kv is not None:
            plan["kv_cache"] = kv
        if moe is not None:
            plan["moe"] = moe
        if memory is not None:
            plan["memory"] = memory
        print(json.dumps(plan))
    else:
        print(render_plan(layout, backend, args.nnodes, args.enable_expert_parallel))
        if moe is not None:
            print("\n" + render_moe_plan(moe))
        if kv is not None:
            print(kv["dtype_line"])
        if kv is not None and gpu_memory is None:  # with --gpu-memory the memory plan answers it
            print(kv["line"])
        if memory is not None:
            from spmd_engine.plan.memory import render_memory
            print("\n" + render_memory(memory))
    if memory is not None and not memory["fits"]:
        print(f"error: {memory['verdict']}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def gpu_memory_from_args(args) -> int | None:
    if args.gpu_memory is None:
        return None
    if args.device != "cuda":
        raise ConfigError("--gpu-memory plans GPU ranks: add --device cuda")
    if args.gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node must be >= 1, got {args.gpus_per_node}")
    from spmd_engine.plan.sizes import parse_size
    return parse_size(args.gpu_memory)


def engine_setup_from_args(args):
    """The engine's checked config for --model (imports torch: only with --model). A path to a
    config.json file stands for its directory: a config alone is enough to plan."""
    from spmd_engine.engine.arg_utils import EngineArgs
    if os.path.isfile(args.model) and os.path.basename(args.model) == "config.json":
        args.model = os.path.dirname(os.path.abspath(args.model))
    return EngineArgs.from_cli_args(args).create_engine_config(check_kv_budget=False)


def memory_plan_from_args(args, setup, layout: Layout, gpu_memory: int | None) -> dict | None:
    """Per-rank memory and the verdict: on CPU, or on GPUs of --gpu-memory bytes (without it a
    GPU's budget is known only on the device, and the KV line says so)."""
    if args.device == "cuda" and gpu_memory is None:
        return None
    from spmd_engine.plan.memory import memory_plan
    return memory_plan(setup, layout, gpu_memory, args.gpus_per_node)


def kv_plan_from_args(setup) -> dict:
    """The KV budget per rank for --model at this layout."""
    from spmd_engine.engine.arg_utils import front_end_kv_plan
    from spmd_engine.platform import choose_dtype
    config, processor = setup.config, setup.inputs
    plan = front_end_kv_plan(config, processor.hf_config, setup.spec)
    dtype, dtype_line = choose_dtype(config.model_config.dtype, processor.hf_config, config.device)
    return {"dtype": str(dtype).removeprefix("torch."), "dtype_line": dtype_line,
            "bytes_per_token": plan.bytes_per_token, "budget_bytes": plan.budget_bytes,
            "block_size": plan.block_size, "num_blocks": plan.num_blocks, "budget_source": plan.source,
            "max_model_len": processor.max_model_len, "line": plan.describe(processor.max_model_len)}


def moe_plan_from_args(args, config: ParallelConfig, layout: Layout) -> dict | None:
    """MoE traffic and expert placement: for a MoE --model, or with --enable-expert-parallel."""
    from spmd_engine.plan.moe import moe_plan
    spec = None
    if args.model:
        from spmd_engine.config import ModelConfig
        from spmd_engine.model.loader import read_hf_config
        from spmd_engine.model.partition import check_model_parallel
        model_dir = ModelConfig(model=args.model).model_dir
        ep_size = layout.dp * layout.pcp * layout.tp if config.enable_expert_parallel else None
        spec = check_model_parallel(read_hf_config(model_dir), layout.tp, layout.pp,
                                    source=os.path.join(model_dir, "config.json"), ep_size=ep_size)
        if spec.moe is None:
            return None
    elif not config.enable_expert_parallel:
        return None
    return moe_plan(layout, config.enable_expert_parallel, spec)


def _live(config: ParallelConfig, layout: Layout) -> int:
    from spmd_engine.distributed.launch_env import launched_rank, read_launch_env
    if read_launch_env(os.environ) is None:
        print("error: --live needs a launcher: run it under torchrun or srun", file=sys.stderr)
        return EXIT_USAGE
    from spmd_engine.distributed.live_check import run_live_check

    ok, verdict = run_live_check(config)
    if launched_rank() == 0:
        print(verdict, flush=True)
    return 0 if ok else 1
