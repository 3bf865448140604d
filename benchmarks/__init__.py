"""spmd_engine's benchmarks, each figure a ratio against a baseline measured in the same run.

    .venv/bin/python -m benchmarks [--only decode,pp,...] [--reps N] [--quick] [--workdir DIR]
    .venv/bin/python scripts/bench.py ...   (the same command line)

`python -m benchmarks --help` lists the figures. They live here, beside the package and not in
it, so nothing of them is installed with the runtime; they reach into the engine's internals
(runner, scheduler, executor) on purpose, and tests/e2e/test_bench_smoke.py runs the figures
that do, so one that rots with the engine fails there.

scripts/ goes on the path here, before any figure module is imported: the figures reuse the
measurement scripts there (make_random_checkpoint, bench_allreduce, bench_rpc_transport), which
also run on their own and so stay where they are."""

import sys
from pathlib import Path

_SCRIPTS = str(Path(__file__).resolve().parent.parent / "scripts")
if _SCRIPTS not in sys.path:
    sys.path.insert(0, _SCRIPTS)
