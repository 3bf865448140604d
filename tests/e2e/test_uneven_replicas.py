"""Replicas that finish far apart are uneven, not hung (issue 15).

Before: rank 0 gathered every replica's records with a gloo collective under the
hang timeout, so a healthy run whose replicas finished more than --timeout apart
failed with a timeout on the gather.
"""

from __future__ import annotations

import json

import pytest
from launch import run_torchrun
from zen import continuation

LONG = ["Beautiful is", "Explicit is", "Simple is", "Complex is", "Flat is"]
SHORT = ["Namespaces are one", "If the implementation is easy", "If the implementation is hard",
         "Namespaces are one honking", "Now is better than never"]


@pytest.mark.timeout(240)
def test_replicas_finishing_more_than_the_timeout_apart_succeed(tmp_path):
    prompts = [p for pair in zip(LONG, SHORT) for p in pair]  # replica 0: the long ones, replica 1: short
    pfile = tmp_path / "prompts.txt"
    pfile.write_text("\n".join(prompts) + "\n")
    out = tmp_path / "out.jsonl"
    launch = run_torchrun(2, ["-m", "spmd_engine.run", "--prompts-file", pfile, "--max-num-seqs", 1,
                              "--timeout", 3, "--output", out, "--quiet"], timeout=200)
    assert launch.returncode == 0 and not launch.timed_out, launch.describe()
    assert not launch.leftover_pids
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in records] == list(range(len(prompts)))
    for r in records:
        assert continuation(r["prompt"]).startswith(r["text"][:40]), r
