"""Run `python -m spmd_engine.run`'s main in this process, stopping where a job would start.

Why: the fuzz tests feed hundreds of bad inputs, and nearly all must be refused before any
process or model exists (checked flags, files, headers, prompts). Running main in-process
with the two job starters replaced costs milliseconds per case instead of a Python start;
everything that decides the exit code and the error line is the real code. A case that
gets past every check reports `started` (and exit 0): its tests decide whether that is the
documented behaviour.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class Outcome:
    rc: int
    stderr: str
    started: bool

    def refused(self, *needles: str) -> bool:
        """Exit 2 with exactly one `error:` line naming every needle."""
        lines = self.stderr.strip().splitlines()
        return (self.rc == 2 and len(lines) == 1 and lines[0].startswith("error: ")
                and all(n in lines[0] for n in needles))


def run_checks(argv: list[str], monkeypatch, capsys, main_module: str = "spmd_engine.run.main") -> Outcome:
    import importlib
    main = importlib.import_module(main_module)
    run = importlib.import_module("spmd_engine.run.main")
    started = []
    monkeypatch.setattr(run, "run_local", lambda *a: started.append("local"))
    monkeypatch.setattr(run, "run_launched", lambda *a: started.append("launched"))
    monkeypatch.setattr(run, "_exit_on_sigterm", lambda: None)  # pytest keeps its own SIGTERM
    capsys.readouterr()
    try:
        rc = main.main([str(a) for a in argv] + ["--quiet"])
    except SystemExit as exc:  # argparse's usage errors
        rc = exc.code
    return Outcome(rc, capsys.readouterr().err, bool(started))


def seeded(seed: int) -> random.Random:
    return random.Random(seed)
