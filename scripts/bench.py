#!/usr/bin/env python
"""spmd_engine's benchmarks: this command runs the benchmarks/ package's CLI (`python -m
benchmarks`), same flags. It stays because the docs, the tests and past runs in
docs/performance.md name it; the figures themselves live in benchmarks/, one module per figure
or group of figures.

    .venv/bin/python scripts/bench.py [--only decode,pp,...] [--reps N] [--quick] [--workdir DIR]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo's benchmarks/ and spmd_engine/

from benchmarks.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
