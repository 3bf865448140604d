"""The command line of scripts/vllm_audit.py: which steps of the audit to run, and the report of
where the automatic guesses and the reviewed verdicts part."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterator

import audit_vllm
from audit_vllm import GUESS_NAMES, PAGE, REPO, SNAPSHOT, VERDICTS
from audit_vllm.extract import write_snapshot
from audit_vllm.page import init_verdicts, load_verdicts, render_page, save_verdicts, totals
from audit_vllm.probe import probe_in_process, run_probe


def print_totals(counts: dict[str, dict[str, int]], names: tuple[str, ...]) -> None:
    width = max(len(c) for c in counts)
    sys.stdout.write(f"{'class':<{width}}  " + "  ".join(f"{n:>7}" for n in names) + "\n")
    for cls, row in counts.items():
        sys.stdout.write(f"{cls:<{width}}  " + "  ".join(f"{row[n]:>7}" for n in names) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=audit_vllm.__doc__.splitlines()[0])
    p.add_argument("--vllm-src", type=Path, help="vLLM's unpacked package directory: write the snapshot")
    p.add_argument("--snapshot", type=Path, default=SNAPSHOT)
    p.add_argument("--classify", action="store_true", help="guess each name's verdict by probing our code")
    p.add_argument("--package-root", type=Path, default=REPO, help="the checkout whose spmd_engine to probe")
    p.add_argument("--diff", action="store_true", help="with --classify: rows whose guess disagrees with the verdicts")
    p.add_argument("--json", action="store_true", help="with --classify: print every guess as JSON")
    p.add_argument("--save-before", action="store_true", help="with --classify: store the totals as 'before'")
    p.add_argument("--init-verdicts", action="store_true", help="add guessed verdicts for names without one")
    p.add_argument("--write-doc", action="store_true", help="write docs/vllm-compatibility.md")
    p.add_argument("--probe-in-process", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.probe_in_process:
        probe_in_process(args.package_root, args.snapshot)
        return 0
    if args.vllm_src:
        write_snapshot(args.vllm_src, args.snapshot)
    snapshot = json.loads(args.snapshot.read_text())
    if args.classify or args.init_verdicts:
        guesses = run_probe(args.package_root, args.snapshot)
        if args.classify:
            report_guesses(guesses, args)
        if args.init_verdicts:
            sys.stdout.write(f"{init_verdicts(guesses, snapshot)} verdicts added to {VERDICTS.relative_to(REPO)}\n")
    if args.write_doc:
        PAGE.write_text(render_page(snapshot, load_verdicts()))
        sys.stdout.write(f"wrote {PAGE.relative_to(REPO)}\n")
    return 0


def report_guesses(guesses: dict, args: argparse.Namespace) -> None:
    counts = totals(guesses, "guess", GUESS_NAMES)
    sys.stdout.write(f"guesses for {args.package_root}:\n")
    print_totals(counts, GUESS_NAMES)
    if args.json:
        sys.stdout.write(json.dumps(guesses, indent=1) + "\n")
    if args.save_before:
        data = load_verdicts()
        data["before"] = counts
        save_verdicts(data)
    if args.diff:
        for cls, name, guess, verdict in disagreements(guesses, load_verdicts()):
            sys.stdout.write(f"{cls}: {name}: guess {guess['guess']} ({guess['detail']}), verdict {verdict}\n")


def disagreements(guesses: dict, verdicts: dict) -> Iterator[tuple[str, str, dict, str]]:
    """Rows whose guess is not their verdict (absent counts as refused); a reviewer reads these."""
    for cls, rows in guesses.items():
        for name, guess in rows.items():
            verdict = verdicts["classes"].get(cls, {}).get(name, {}).get("verdict", "(none)")
            if ("refused" if guess["guess"] == "absent" else guess["guess"]) != verdict:
                yield cls, name, guess, verdict
