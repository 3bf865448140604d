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

from spmd_engine.config import DEFAULT_MAX_NUM_SEQS, DTYPES, LOGPROBS_MODES, ConfigError
from spmd_engine.distributed.launch_env import launched_rank
from spmd_engine.run.cli_args import (
    EXIT_USAGE,
    UsageParser,
    add_cache_args,
    add_parallel_args,
    check_cache_args,
    seconds,
)
from spmd_engine.run.error_file import AtomicErrorHandler, record_for_torchrun
from spmd_engine.run.jobs import check_launched_world, prompts_to_do, run_launched, run_local
from spmd_engine.run.lora_modules import add_lora_args, check_adapter_dirs, served_adapters
from spmd_engine.run.prompts import load_prompts, read_chat_template
from spmd_engine.run.records import PromptJob, print_records
from spmd_engine.run.stderr_line import report
from spmd_engine.sampling_params import SamplingParams
from spmd_engine.topology import TopologyError

if TYPE_CHECKING:
    from spmd_engine.engine.arg_utils import EngineSetup

logger = logging.getLogger("spmd_engine")

EXIT_RUNTIME = 1
DEFAULT_MAX_TOKENS = 1024  # enough for the bundled model to recite its whole text


def build_parser() -> UsageParser:
    p = UsageParser(prog="python -m spmd_engine.run", description=__doc__.splitlines()[0])
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", default=None,
                   help='.txt: one prompt a line; .jsonl: {"prompt": str}, {"prompt_token_ids": [int]} '
                        'or {"messages": [{"role", "content"}, ...]} a line')
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--logprobs", type=int, default=None, metavar="K")
    p.add_argument("--output", default=None, metavar="FILE.jsonl",
                   help="results, in input order; streamed to FILE.jsonl.part-* while the run goes")
    add_job_args(p)
    return p


def add_job_args(p: UsageParser) -> None:
    """The flags of run and run_batch alike: model, layout, cache, seed, chat template, resume."""
    p.add_argument("--model", default=None, help="HF-format directory (config.json + *.safetensors); "
                                                 "default: the bundled model")
    add_parallel_args(p)
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="jinja chat template for conversations (default: the checkpoint's, from "
                        "tokenizer_config.json or chat_template.jinja)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=DTYPES, default=None)
    p.add_argument("--batch-invariant", action="store_true", default=None,
                   help="bitwise reproducible outputs whatever the batch, cache and layout "
                        "(README, batch-invariant mode); also VLLM_BATCH_INVARIANT=1")
    p.add_argument("--enforce-eager", action="store_true", default=None,
                   help="run the model eager, no torch.compile (also SPMD_ENGINE_ENFORCE_EAGER=1)")
    p.add_argument("--compilation-config", "-O", default=None, metavar="LEVEL|JSON",
                   help="vLLM's compilation config: a level (0 eager, 1-3 compiled) or JSON, e.g. "
                        "'{\"level\": 3, \"min_tokens\": 16}' (docs/running.md)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS)
    p.add_argument("--logprobs-mode", choices=LOGPROBS_MODES, default="raw_logprobs",
                   help="what logprobs hold (vLLM's modes): raw or processed, logprobs or logits")
    add_cache_args(p)
    p.add_argument("--pp-partition", default=None, metavar="3,3,2",
                   help="layers per PP stage (default: vLLM's even split)")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted output file: skip inputs its part files already hold")
    p.add_argument("--timeout", type=seconds, default=None, metavar="SECONDS",
                   help="limit for every collective and worker call (default: SPMD_ENGINE_TIMEOUT_S or 300)")
    p.add_argument("--quiet", action="store_true", help="no logs or progress")
    add_lora_args(p)


def sampling_params_from_args(args) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=None, logprobs=args.logprobs)


def check_args(args) -> None:
    """The flags every job shares, checked before any file or model is read."""
    check_cache_args(args)
    if args.output and os.path.isdir(args.output):
        raise ConfigError(f"--output {args.output} is a directory")
    if args.output and not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        raise ConfigError(f"--output {args.output}: its directory does not exist")
    if args.output:
        check_writable(args.output)


def check_writable(output: str) -> None:
    """--output's directory must take new files (the part files, the merged result): tried now
    with a temporary file, removed at once, so a read-only directory fails before any model
    load rather than at the first result. Not os.access: as root it says yes to everything."""
    import tempfile
    directory = os.path.dirname(os.path.abspath(output))
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".spmd-engine-write-check-"):
            pass
    except OSError as exc:
        raise ConfigError(f"--output {output}: cannot create files in {directory}: {exc.strerror}") from None


def load_job(args) -> PromptJob:
    """run's job: the prompts of --prompt or --prompts-file, with the sampling flags."""
    check_args(args)
    if args.prompt and args.prompts_file:
        raise ConfigError("give prompts with --prompt or --prompts-file, not both")
    adapters = served_adapters(args, args.model or "bundled")
    prompts = load_prompts(args.prompt, args.prompts_file)
    for prompt in prompts:  # every line's adapter name known before any model is read
        try:
            adapters.for_line(prompt.adapter)
        except ConfigError as exc:
            raise ConfigError(f"{prompt.where}: {exc}") from None
    return PromptJob(prompts, sampling_params_from_args(args), read_chat_template(args.chat_template), adapters)


def check_model_and_job(args, job) -> "EngineSetup":
    """The engine's configuration (the model against the layout, the KV budget), the
    checkpoint's headers, then every input against the model: before any process starts."""
    from spmd_engine.engine.arg_utils import EngineArgs
    from spmd_engine.model.checkpoint_check import check_checkpoint
    setup = EngineArgs.from_cli_args(args).create_engine_config()
    check_checkpoint(setup.config.model_config.model_dir, setup.spec)
    check_adapter_dirs(job.adapters, setup)
    job.check(setup)
    return setup


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


def _exit_on_sigterm() -> None:
    """SIGTERM unwinds like SIGINT, so `finally` blocks stop workers and free shared memory."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    return execute(build_parser().parse_args(argv), load_job)


def execute(args, load_job) -> int:
    """A job from start to exit code, alone or under a launcher (run and run_batch):
    `load_job(args)` reads and checks its input before any model is read."""
    _exit_on_sigterm()
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format=f"[rank{launched_rank()}] %(message)s")
    rank0 = launched_rank() == 0
    try:
        job = load_job(args)
        launched = _launched() and args.distributed_executor_backend in (None, "external_launcher")
        if launched:
            args.distributed_executor_backend = "external_launcher"
        setup = check_model_and_job(args, job)
        todo, ident = prompts_to_do(args, job)
        if launched:
            check_launched_world(setup)
            records = run_launched(args, setup, job, todo, ident)
        else:
            records = run_local(args, setup, job, todo, ident)
    except (ConfigError, TopologyError) as exc:
        if rank0:
            flag = getattr(exc, "flag", None)
            report(f"error: {flag + ': ' if flag else ''}{exc}")
        elif _launched():
            _let_rank0_report_first()
        return EXIT_USAGE
    except KeyboardInterrupt:
        report(f"error: [rank {launched_rank()}] interrupted")
        return 130
    except Exception as exc:  # runtime failure: one line per rank that saw it
        report(f"error: [rank {launched_rank()}] {type(exc).__name__}: {exc}")
        record_for_torchrun(exc)
        return EXIT_RUNTIME
    if records is not None:
        print_records(records)
    return 0


def entry(main_function=None) -> None:
    """Console-script entry (of run, or of run_batch's `main_function`); torchrun's @record
    writes the root cause to its error file."""
    main_function = main_function or main
    from spmd_engine.run.stop_guard import start as start_stop_guard
    start_stop_guard()  # console scripts: python -m started it already, before torch
    try:
        from torch.distributed.elastic.multiprocessing.errors import record
    except ImportError:  # pragma: no cover
        sys.exit(main_function())
    sys.exit(record(main_function, error_handler=AtomicErrorHandler())())
