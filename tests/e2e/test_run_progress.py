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
MAX_TOKENS = 40  # 20 rounds of 2 sequences x 40 steps: seconds, so redraws every 0.2 s come before the end


def run(tmp_path, name, tty: bool, *extra):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    out = tmp_path / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "spmd_engine.run", "--prompts-file", str(prompts), "--max-tokens", str(MAX_TOKENS),
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


def progress_problems(err: str) -> list[str]:
    """What is wrong with the progress lines in a run's terminal output: they must count up
    through several redraws before the end (not one final line), and end at 40 requests."""
    updates = [u for u in err.replace("\r\n", "\n").replace("\r", "\n").splitlines() if u.startswith("[progress]")]
    done = [int(u.split()[1].split("/")[0]) for u in updates]
    problems = []
    if not done or done[-1] != 40 or done != sorted(done):
        problems.append(f"counts {done} do not rise to 40")
    if len([d for d in done if d < 40]) < 2:
        problems.append(f"fewer than 2 updates before the end: {done}")
    if not updates or "tok/s" not in updates[-1] or f" {40 * MAX_TOKENS} tokens" not in updates[-1]:
        problems.append(f"last update {updates[-1:]} lacks the token total {40 * MAX_TOKENS} or tok/s")
    return problems


def test_progress_check_rejects_a_single_final_update():
    """Negative control: one final line (what a progress that only prints at the end shows) fails."""
    final = f"[progress] 40/40 requests, {40 * MAX_TOKENS} tokens, 500.0 tok/s, 3s\n"
    assert progress_problems(final)
    assert progress_problems("\r[progress] 12/40 requests, 480 tokens, 1.0 tok/s, 1s" + "\r" + final)
    rising = "".join(f"\r[progress] {n}/40 requests, {n * MAX_TOKENS} tokens, 1.0 tok/s, 1s" for n in (8, 20))
    assert not progress_problems(rising + "\r" + final)
    assert progress_problems(rising + f"\r[progress] 38/40 requests, {38 * MAX_TOKENS} tokens, 1.0 tok/s, 3s\n")


def assert_progress_reached_the_end(err: str) -> None:
    problems = progress_problems(err)
    assert not problems, (problems, err)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", [{}, {"data_parallel_size": 2}], ids=["uni", "mp-dp2"])
def test_progress_callback_is_called_as_requests_finish(layout):
    """LLM.generate(progress=fn): fn hears of requests while the call runs, not once at the end.
    Six equal prompts, two at a time: three batches finish one after another."""
    from spmd_engine import LLM, SamplingParams

    calls = []
    with LLM(max_num_seqs=2, **layout) as llm:
        outs = llm.generate(PROMPTS[:6], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                            progress=lambda requests, tokens: calls.append((requests, tokens)))
    assert sum(r for r, _ in calls) == 6 and sum(t for _, t in calls) == 30, calls
    assert len(calls) >= 3, calls  # at least one call per finished batch
    assert all(len(o.outputs[0].token_ids) == 5 for o in outs)


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
