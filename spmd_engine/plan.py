"""`python -m spmd_engine.plan`: the layout a launch will have, before spending GPU hours.

Without `--live` this is pure arithmetic and runs anywhere. With `--live`, run
under torchrun or srun: it brings every group up for real and checks, with
collectives, that each rank's groups are the ones printed here.
"""

from __future__ import annotations

import json
import os
import sys

from spmd_engine.cli_args import EXIT_USAGE, UsageParser, add_parallel_args, parallel_config_from_args
from spmd_engine.config import ConfigError, ParallelConfig, launched_by_torchrun
from spmd_engine.plan_report import plan_dict, render_plan
from spmd_engine.topology import Layout, TopologyError


def build_parser() -> UsageParser:
    parser = UsageParser(prog="python -m spmd_engine.plan", description=__doc__.splitlines()[0])
    add_parallel_args(parser)
    parser.add_argument("--world-size", type=int, default=None, metavar="N",
                        help="launched ranks (default: TP x PP x PCP x DP; under torchrun: WORLD_SIZE); "
                             "a multiple gives external-DP replicas")
    parser.add_argument("--json", action="store_true", help="print DESIGN 4.2's JSON object")
    parser.add_argument("--live", action="store_true",
                        help="under torchrun/srun: build the groups and verify them with collectives")
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
    except (ConfigError, TopologyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.live:
        return _live(config, layout)
    if args.json:
        print(json.dumps(plan_dict(layout, backend, args.nnodes)))
    else:
        print(render_plan(layout, backend, args.nnodes, args.enable_expert_parallel))
    return 0


def _live(config: ParallelConfig, layout: Layout) -> int:
    from spmd_engine.distributed.launch_env import read_launch_env
    if read_launch_env(os.environ) is None:
        print("error: --live needs a launcher: run it under torchrun or srun", file=sys.stderr)
        return EXIT_USAGE
    from spmd_engine.distributed.live_check import run_live_check

    ok, verdict = run_live_check(config)
    if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0:
        print(verdict, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
