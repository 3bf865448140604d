"""`python -m spmd_engine.run`: generate for a list of prompts, alone or under a launcher.

Under torchrun or srun every process runs this same file: it finds its replica
from its global rank, generates its share of the prompts, and global rank 0
gathers every replica's results and writes them once, in input order. Without
a launcher, LLM does the same with its own processes (mp) or in this one (uni).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

from typing import TYPE_CHECKING

from spmd_engine import topology
from spmd_engine.run.cli_args import (
    EXIT_USAGE, UsageParser, add_cache_args, add_parallel_args, check_cache_args,
)
from spmd_engine.config import DEFAULT_MAX_NUM_SEQS, DTYPES, ConfigError
from spmd_engine.run.output_parts import PartWriter, index_parts, job_identity, merge_parts, restarted
from spmd_engine.run.prompts import PromptInput, load_prompts
from spmd_engine.sampling_params import SamplingParams
from spmd_engine.topology import TopologyError

if TYPE_CHECKING:
    from spmd_engine.engine.arg_utils import EngineSetup

logger = logging.getLogger("spmd_engine")

EXIT_RUNTIME = 1
DEFAULT_MAX_TOKENS = 1024  # enough for the bundled model to recite its whole text


def build_parser() -> UsageParser:
    p = UsageParser(prog="python -m spmd_engine.run", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF-format directory (config.json + *.safetensors); "
                                                 "default: the bundled model")
    add_parallel_args(p)
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", default=None,
                   help='.txt: one prompt a line; .jsonl: {"prompt": str} or {"prompt_token_ids": [int]} a line')
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logprobs", type=int, default=None, metavar="K")
    p.add_argument("--dtype", choices=DTYPES, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS)
    add_cache_args(p)
    p.add_argument("--pp-partition", default=None, metavar="3,3,2",
                   help="layers per PP stage (default: vLLM's even split)")
    p.add_argument("--output", default=None, metavar="FILE.jsonl",
                   help="results, in input order; streamed to FILE.jsonl.part-* while the run goes")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted --output run: skip prompts its part files already hold")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="limit for every collective and worker call (default: SPMD_ENGINE_TIMEOUT_S or 300)")
    p.add_argument("--quiet", action="store_true", help="no logs or progress")
    return p


def sampling_params_from_args(args) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=None, logprobs=args.logprobs)


def check_args(args) -> None:
    check_cache_args(args)
    if args.prompt and args.prompts_file:
        raise ConfigError("give prompts with --prompt or --prompts-file, not both")
    if args.output and os.path.isdir(args.output):
        raise ConfigError(f"--output {args.output} is a directory")
    if args.output and not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        raise ConfigError(f"--output {args.output}: its directory does not exist")


def check_model_and_prompts(args, prompts: list[PromptInput]) -> "EngineSetup":
    """The engine's configuration (the model against the layout, the KV budget), the
    checkpoint's headers, then every prompt against the model: before any process starts."""
    from spmd_engine.engine.arg_utils import EngineArgs
    from spmd_engine.model.loader import check_checkpoint
    setup = EngineArgs.from_cli_args(args).create_engine_config()
    check_checkpoint(setup.config.model_config.model_dir)
    for index, prompt in enumerate(prompts):
        setup.inputs.encode(prompt.as_llm_input(), index)
    return setup


def result_record(index: int, prompt: PromptInput, out) -> dict:
    completion = out.outputs[0]
    record = {
        "index": index,
        "prompt": prompt.text,
        "prompt_token_ids": out.prompt_token_ids,
        "token_ids": completion.token_ids,
        "text": completion.text,
        "finish_reason": completion.finish_reason,
    }
    if completion.logprobs is not None:
        record["logprobs"] = [{str(k): v.logprob for k, v in step.items()} for step in completion.logprobs]
    return record


class Progress:
    """Requests done and tokens/s on stderr, for a person watching a long run.

    Shown by global rank 0 only, and only when stderr is a terminal and --quiet
    is off, so tests and torchrun's --tee / --log-dir files stay clean. Under a
    launcher rank 0 sees its own replica, and says so. Fed by the engine as
    requests finish; redrawn at most every REDRAW_S seconds, and at the end.
    """

    REDRAW_S = 0.2

    def __init__(self, total: int, label: str = "", stream=None):
        self.total, self.label, self.stream = total, label, stream or sys.stderr
        self.done = self.tokens = 0
        self.start = self.drawn = time.monotonic()

    def update(self, requests: int, tokens: int) -> None:
        self.done += requests
        self.tokens += tokens
        now = time.monotonic()
        if self.done < self.total and now - self.drawn < self.REDRAW_S:
            return
        self.drawn = now
        elapsed = max(now - self.start, 1e-9)
        end = "\n" if self.done >= self.total else ""
        print(f"\r[progress] {self.done}/{self.total} requests{self.label}, {self.tokens} tokens, "
              f"{self.tokens / elapsed:.1f} tok/s, {elapsed:.0f}s", end=end, file=self.stream, flush=True)


def progress_wanted(args) -> bool:
    return not args.quiet and _global_rank() == 0 and sys.stderr.isatty()


def generate_records(llm, prompts: list[PromptInput], params: SamplingParams, indices: list[int],
                     progress: Progress | None = None, sink=None) -> list[dict]:
    """Generate for a share of the prompts, seeding each by its global index (a replica's
    share can be empty: fewer prompts than replicas). `sink.append(record)` gets each
    record as soon as its request finishes (the part file)."""
    if not indices:
        if llm.dp_waves:  # no prompts here, but the other replicas' steps need this one's
            llm.generate([], params)
        return []
    from dataclasses import replace

    from spmd_engine.engine.llm import request_seed
    per_prompt = [replace(params, seed=request_seed(llm.seed, i)) for i in indices]
    on_output = None
    if sink is not None:
        def on_output(position, out):
            sink.append(result_record(indices[position], prompts[indices[position]], out))
    outs = llm.generate([prompts[i].as_llm_input() for i in indices], per_prompt,
                        progress=progress.update if progress is not None else None, on_output=on_output)
    return [result_record(i, prompts[i], out) for i, out in zip(indices, outs)]


def check_launched_world(setup: "EngineSetup") -> None:
    """The launcher's world must hold whole replicas: fail on every rank before any rendezvous."""
    from spmd_engine.distributed.launch_env import read_launch_env
    launch = read_launch_env(os.environ)
    if launch is not None:
        topology.Layout.of(setup.config.parallel_config, launch.world_size)


def check_same_invocation(args, prompts: list[PromptInput]) -> None:
    """Every rank must have the same flags and prompts; compare a hash through the
    launcher's store before any group or model exists, and fail on every rank.

    Rank 0 alone reads every rank's hash and publishes the verdict; the others read
    only that, so the check costs O(world) store operations in all, not O(world^2).
    """
    import hashlib

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store
    digest = hashlib.sha256(repr((sorted(vars(args).items()), prompts)).encode()).hexdigest()
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


def run_launched(args, setup, prompts, params, todo: list[int], ident: dict | None) -> list[dict] | None:
    """Under torchrun/srun: this replica's share of `todo`, streamed to its part file (with
    --output) and merged by global rank 0, or gathered to global rank 0 and returned."""
    from spmd_engine.distributed import init_distributed_environment
    init_distributed_environment(timeout_s=args.timeout)
    check_same_invocation(args, prompts)
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
            records = generate_records(llm, prompts, params, indices, progress=progress)
            if is_head:
                log_engine_stats(llm, first_replica=replica)
            return gather_records(records, world.rank, is_head, heads)
        writer = PartWriter(args.output, ident, replica) if is_head else None
        try:
            generate_records(llm, prompts, params, indices, progress=progress, sink=writer)
        finally:
            if writer is not None:
                writer.close()
        if is_head:
            log_engine_stats(llm, first_replica=replica)
        gather_records([], world.rank, is_head, heads)  # every part is complete: rank 0 merges
        if world.rank == 0:
            merge_parts(args.output, ident, len(prompts))
        return None
    finally:
        llm.shutdown()


def gather_records(records: list[dict], rank: int, is_replica_head: bool, heads: list[int]) -> list[dict] | None:
    """Every replica head's records to global rank 0, through the launcher's store.

    Not a collective: a collective runs under the hang timeout, and replicas that
    finish more than --timeout apart are merely uneven, not hung. Rank 0 polls the
    store with no deadline; a replica that died instead still ends the job (torchrun
    and srun --kill-on-bad-exit stop every rank when one fails).
    """
    import pickle

    from torch.distributed.distributed_c10d import _get_default_store
    store = _get_default_store()
    key = "spmd_engine/results/{}".format
    if is_replica_head:
        store.set(key(rank), pickle.dumps(records))
    if rank != 0:
        return None
    keys = [key(r) for r in heads]
    while not store.check(keys):
        time.sleep(0.1)
    merged = [r for k in keys for r in pickle.loads(store.get(k))]
    return sorted(merged, key=lambda r: r["index"])


def run_local(args, setup, prompts, params, todo: list[int], ident: dict | None) -> list[dict] | None:
    from spmd_engine.engine.llm import LLM
    llm = LLM.from_engine_setup(setup)
    try:
        progress = Progress(len(todo)) if progress_wanted(args) else None
        if args.output is None:
            records = generate_records(llm, prompts, params, todo, progress=progress)
            log_engine_stats(llm)
            return records
        writer = PartWriter(args.output, ident, 0)
        try:
            generate_records(llm, prompts, params, todo, progress=progress, sink=writer)
        finally:
            writer.close()
        log_engine_stats(llm)
    finally:
        llm.shutdown()
    merge_parts(args.output, ident, len(prompts))
    return None


def prompts_to_do(args, prompts: list[PromptInput]) -> tuple[list[int], dict | None]:
    """Which prompts this run generates: all, or (resuming) those no part file holds yet.

    Every rank reads the parts before any group exists, and no writer opens its part
    before the groups are built (a world-wide collective), so every rank sees the same.
    """
    if args.output is None:
        if args.resume:
            raise ConfigError("--resume needs --output: it continues that file's part files")
        return list(range(len(prompts))), None
    ident = job_identity(args, prompts)
    index = index_parts(args.output, ident)
    if not index.parts:
        return list(range(len(prompts))), ident
    why = "--resume" if args.resume else restarted()
    if why is None:
        raise ConfigError(f"--output {args.output}: {len(index.parts)} part files of an interrupted run "
                          f"are there ({len(index.locations)} records); pass --resume to continue it, "
                          f"or delete {args.output}.part-*")
    todo = [i for i in range(len(prompts)) if i not in index.locations]
    logger.info("resuming (%s): %d of %d prompts done in %d part files, %d to go", why,
                len(index.locations), len(prompts), len(index.parts), len(todo))
    return todo, ident


def print_records(records: list[dict]) -> None:
    """Without --output: every result on stdout, in input order (with --output the part
    files are merged into the file instead; see spmd_engine.run.output_parts)."""
    for r in records:
        header = f"=== prompt {r['index']} ({r['finish_reason']}, {len(r['token_ids'])} tokens)"
        print(header)
        print((r["prompt"] or "") + r["text"], flush=True)


def _global_rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def _launched() -> bool:
    from spmd_engine.distributed.launch_env import read_launch_env
    return read_launch_env(os.environ) is not None


RANK0_REPORT_WAIT_S = 10.0


def _let_rank0_report_first() -> None:
    """Every rank finds a usage error, only rank 0 prints it. A launcher ends the whole
    job at the first rank that exits, so a rank that exits before rank 0 has printed can
    get rank 0 killed mid-report (seen under load). The others wait instead, briefly: the
    launcher ends them as soon as rank 0 exits (torchrun; srun --kill-on-bad-exit), and
    without one they exit 2 themselves after RANK0_REPORT_WAIT_S."""
    deadline = time.monotonic() + RANK0_REPORT_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(0.1)


def _record_for_torchrun(exc: BaseException) -> None:
    """Write torchrun's error file, so its summary names this rank's root cause."""
    if "TORCHELASTIC_ERROR_FILE" not in os.environ:
        return
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
        ErrorHandler().record_exception(exc)
    except Exception:  # the error line above already went out; never mask it
        pass


def _exit_on_sigterm() -> None:
    """SIGTERM unwinds like SIGINT, so `finally` blocks stop workers and free shared memory."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _exit_on_sigterm()
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format=f"[rank{_global_rank()}] %(message)s")
    rank0 = _global_rank() == 0
    try:
        check_args(args)
        prompts = load_prompts(args.prompt, args.prompts_file)
        params = sampling_params_from_args(args)
        launched = _launched() and args.distributed_executor_backend in (None, "external_launcher")
        if launched:
            args.distributed_executor_backend = "external_launcher"
        setup = check_model_and_prompts(args, prompts)
        todo, ident = prompts_to_do(args, prompts)
        if launched:
            check_launched_world(setup)
            records = run_launched(args, setup, prompts, params, todo, ident)
        else:
            records = run_local(args, setup, prompts, params, todo, ident)
    except (ConfigError, TopologyError) as exc:
        if rank0:
            flag = getattr(exc, "flag", None)
            print(f"error: {flag + ': ' if flag else ''}{exc}", file=sys.stderr)
        elif _launched():
            _let_rank0_report_first()
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"error: [rank {_global_rank()}] interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # runtime failure: one line per rank that saw it
        print(f"error: [rank {_global_rank()}] {type(exc).__name__}: {exc}", file=sys.stderr)
        _record_for_torchrun(exc)
        return EXIT_RUNTIME
    if records is not None:
        print_records(records)
    return 0


def entry() -> None:
    """Console-script entry; torchrun's @record writes the root cause to its error file."""
    try:
        from torch.distributed.elastic.multiprocessing.errors import record
    except ImportError:  # pragma: no cover
        sys.exit(main())
    sys.exit(record(main)())
