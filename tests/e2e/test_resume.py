"""Long batch jobs: streamed part files, --resume, torchrun --max-restarts (issue 15).

Before: every record stayed in memory until the end, so a kill at hour 5 lost
5 hours; rank 0 gathered every replica's records in one object.
Kills here are triggered by a record reaching a part file, never by a sleep.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from launch import REPO, base_env, run_torchrun
from part_files import kill_after_records, records_in_parts, wait_for_records

PROMPTS = ["Beautiful is", "Explicit is", "Simple is", "Complex is", "Flat is", "Sparse is",
           "Readability", "Errors should"]
FLAGS = ["--max-tokens", "120", "--max-num-seqs", "1", "--seed", "5"]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


@pytest.fixture(scope="module")
def reference(prompts_file, tmp_path_factory) -> bytes:
    out = tmp_path_factory.mktemp("ref") / "ref.jsonl"
    proc = subprocess.run([sys.executable, "-m", "spmd_engine.run", "--prompts-file", str(prompts_file), *FLAGS,
                           "--output", str(out), "--quiet"], cwd=REPO, env=base_env("resume-ref"),
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr
    assert not list(out.parent.glob("*.part-*"))  # merged and removed
    return out.read_bytes()


def run_cli(args, tag, timeout=150) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spmd_engine.run", *map(str, args)], cwd=REPO,
                          env=base_env(tag), capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(300)
def test_resume_after_sigkill_of_the_whole_job(tmp_path, prompts_file, reference):
    out = tmp_path / "out.jsonl"
    tag = f"resume{os.getpid()}"
    args = ["-m", "spmd_engine.run", "--prompts-file", prompts_file, *FLAGS, "--output", out, "--quiet"]
    done_before = kill_after_records(args, out, 2, tag)
    assert 2 <= done_before < len(PROMPTS) and not out.exists()

    # Without --resume the parts are not silently overwritten or mixed in.
    fresh = run_cli(["--prompts-file", prompts_file, *FLAGS, "--output", out, "--quiet"], tag)
    assert fresh.returncode == 2 and "pass --resume" in fresh.stderr, fresh.stderr
    # Different flags: exit 2, naming what differs.
    other = run_cli(["--prompts-file", prompts_file, *FLAGS, "--max-tokens", "60", "--output", out, "--resume",
                     "--quiet"], tag)
    assert other.returncode == 2 and "max-tokens 120 (now 60)" in other.stderr, other.stderr
    assert other.stderr.count("\n") == 1 and other.stderr.startswith("error: cannot resume:")

    resumed = run_cli(["--prompts-file", prompts_file, *FLAGS, "--output", out, "--resume"], tag)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{done_before} of {len(PROMPTS)} prompts done" in resumed.stderr, resumed.stderr
    assert out.read_bytes() == reference  # byte-identical to an uninterrupted run
    assert not list(tmp_path.glob("out.jsonl.part-*")) and not list(tmp_path.glob("*.tmp.*"))


def ranks_with_marker(marker: str) -> dict[int, int]:
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = dict(kv.split(b"=", 1) for kv in (entry / "environ").read_bytes().split(b"\0") if b"=" in kv)
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError):
            continue
        if (env.get(b"SPMD_TEST_MARKER") == marker.encode() and b"RANK" in env and state != "Z"
                and env.get(b"TORCHELASTIC_RESTART_COUNT", b"0") == b"0"):
            found[int(env[b"RANK"])] = int(entry.name)
    return found


@pytest.mark.timeout(400)
def test_torchrun_max_restarts_recovers_a_killed_rank(tmp_path, prompts_file, reference):
    out = tmp_path / "out.jsonl"
    marker = f"restart{os.getpid()}"
    result: dict = {}

    def killer():
        if not wait_for_records(out, 1, timeout=200):
            return
        ranks = ranks_with_marker(marker)
        if 2 in ranks:
            result["records_at_kill"] = records_in_parts(out)
            os.kill(ranks[2], signal.SIGKILL)  # a rank of replica 1, mid-run

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    # World 4, TP=2: two replicas. torchrun restarts the whole group once.
    launch = run_torchrun(4, ["--max-restarts", 1, "-m", "spmd_engine.run", "-tp", 2,
                              "--prompts-file", prompts_file, *FLAGS, "--output", out],
                          timeout=350, env_extra={"SPMD_TEST_MARKER": marker})
    thread.join(timeout=5)
    assert "records_at_kill" in result, launch.describe()
    assert launch.returncode == 0 and not launch.timed_out, launch.describe()
    assert not launch.leftover_pids
    assert "resuming (torchrun restart)" in launch.stderr, launch.describe()
    assert out.read_bytes() == reference
    merged = re.search(r"merged \d+ records from \d+ part files into .* \((\d+) generated twice\)", launch.stderr)
    assert merged, launch.describe()
    assert int(merged.group(1)) <= 2  # at most the in-flight ones: one sequence per replica
    assert not list(tmp_path.glob("out.jsonl.part-*"))
