"""Progress on a terminal: rank 0 shows requests done and tokens/s on stderr, only on a TTY.

The engine reports requests as they finish; showing progress must not change the output file.
"""

from __future__ import annotations

import os
import pty
import subprocess
import sys

import pytest

from launch import REPO, base_env

PROMPTS = ["Beautiful is", "Simple is", "Errors should", "Now is", "Readability"] * 8  # 40 prompts


def run(tmp_path, name, tty: bool, *extra):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    out = tmp_path / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "spmd_engine.run", "--prompts-file", str(prompts), "--max-tokens", "8",
           "--max-num-seqs", "2", "--output", str(out), *extra]
    if not tty:
        proc = subprocess.run(cmd, cwd=REPO, env=base_env("progress"), capture_output=True, text=True, timeout=100)
        return proc.returncode, proc.stderr, out.read_text()
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(cmd, cwd=REPO, env=base_env("progress"), stdout=subprocess.DEVNULL, stderr=slave)
        os.close(slave)
        chunks = []
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        rc = proc.wait(timeout=100)
    finally:
        os.close(master)
    return rc, b"".join(chunks).decode(errors="replace"), out.read_text()


def assert_progress_reached_the_end(err: str) -> None:
    updates = [u for u in err.replace("\r\n", "\n").replace("\r", "\n").splitlines() if u.startswith("[progress]")]
    done = [int(u.split()[1].split("/")[0]) for u in updates]
    assert done and done == sorted(done) and done[-1] == 40, err  # redrawn at most every 0.2 s
    assert "tok/s" in updates[-1] and " 320 tokens" in updates[-1], err


@pytest.mark.timeout(120)
def test_progress_only_on_a_terminal_and_output_unchanged(tmp_path):
    rc, err, plain = run(tmp_path, "plain", tty=False)
    assert rc == 0 and "[progress]" not in err, err
    rc, err, shown = run(tmp_path, "tty", tty=True)
    assert rc == 0, err
    assert_progress_reached_the_end(err)
    assert shown == plain
    rc, err, _ = run(tmp_path, "quiet", True, "--quiet")
    assert rc == 0 and "[progress]" not in err, err


@pytest.mark.timeout(120)
def test_progress_counts_every_replica_of_a_dp_run(tmp_path):
    """DP=2 under mp: each EngineCore_DP process relays its finished requests to the front end."""
    rc, err, shown = run(tmp_path, "dp", True, "-dp", "2")
    assert rc == 0, err
    assert_progress_reached_the_end(err)
    _, _, plain = run(tmp_path, "plain", False)
    assert shown == plain
