"""`python -m spmd_engine.run_batch -i requests.jsonl -o results.jsonl`: OpenAI batch files.

vLLM's `run-batch` for the layouts of `run`: the same flags (model, -tp/-pp/-dp, the
backend, cache, seed), the same launch under torchrun or srun, the same streamed part
files, --resume and requeue. Each line of the input is one /v1/completions or
/v1/chat/completions request; each line of the output its result, in input order.
"""

from __future__ import annotations

import os

from spmd_engine.run.cli_args import UsageParser
from spmd_engine.run.lora_modules import served_adapters
from spmd_engine.run.main import add_job_args, check_args, execute
from spmd_engine.run.main import entry as run_entry
from spmd_engine.run.prompts import read_chat_template
from spmd_engine.run_batch.job import BatchJob
from spmd_engine.run_batch.requests import read_requests


def build_parser() -> UsageParser:
    p = UsageParser(prog="python -m spmd_engine.run_batch", description=__doc__.splitlines()[0])
    p.add_argument("-i", "--input-file", required=True, metavar="FILE.jsonl", help="OpenAI batch requests")
    p.add_argument("-o", "--output-file", dest="output", required=True, metavar="FILE.jsonl",
                   help="results, in input order; streamed to FILE.jsonl.part-* while the run goes")
    p.add_argument("--served-model-name", default=None,
                   help='"model" of a response whose request names none (default: --model, or "bundled")')
    add_job_args(p)
    return p


def load_job(args) -> BatchJob:
    check_args(args)
    requests, data = read_requests(args.input_file)
    created = int(os.stat(args.input_file).st_mtime)
    name = args.served_model_name or args.model or "bundled"
    adapters = served_adapters(args, name)
    return BatchJob(requests, data, created, name, read_chat_template(args.chat_template), adapters)


def main(argv: list[str] | None = None) -> int:
    return execute(build_parser().parse_args(argv), load_job)


def entry() -> None:
    run_entry(main)
