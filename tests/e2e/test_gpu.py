"""CUDA paths for real: NCCL groups and a TP=2 run on GPUs. Skipped without GPUs.

Run on a GPU machine by scripts/ci/run_distributed_matrix.sh (marker `gpu`).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from launch import REPO, base_env, run_checked, run_torchrun
from zen import continuation

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_1_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
needs_2_gpus = pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")

PROMPTS = ["Beautiful is", "Errors should"]
COMMON = ["--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--max-tokens", "24", "--quiet"]
RUN_TP2 = ["-m", "spmd_engine.run", "-tp", "2", *COMMON]


def test_gpu_commands_are_valid_argv():
    """Runs everywhere: the GPU tests' command lines are lists of strings, so they do not die
    with a TypeError before reaching a GPU (they once passed the int 2 and never ran)."""
    for argv in ([sys.executable, *RUN_TP2], RUN_TP2):
        assert all(isinstance(a, str) for a in argv), argv
    proc = subprocess.run([sys.executable, *RUN_TP2, "--help"], cwd=REPO, env=base_env("gpu-argv"),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--tensor-parallel-size" in proc.stdout, proc.stderr


@pytest.mark.gpu
@needs_1_gpu
@pytest.mark.timeout(180)
def test_nccl_collectives_across_every_gpu():
    launch = run_torchrun(GPUS, [REPO / "tests" / "helpers" / "dist_scripts" / "nccl_check.py"], timeout=160)
    assert not launch.timed_out and launch.returncode == 0, launch.describe()
    lines = [line for line in launch.stdout.splitlines() if line.startswith("rank ")]
    assert len(lines) == GPUS and all(" ok " in line and "backend=nccl" in line for line in lines), lines
    devices = sorted(line.split("device=")[1].split()[0] for line in lines)
    assert devices == sorted(f"cuda:{i}" for i in range(GPUS))  # local rank = device index
    assert not launch.leftover_pids


@pytest.mark.gpu
@needs_2_gpus
@pytest.mark.timeout(240)
def test_tp2_on_cuda_under_torchrun_and_mp():
    expected = "".join(f"=== prompt {i} (length, 24 tokens)\n{p}{continuation(p)[:24]}\n"
                       for i, p in enumerate(PROMPTS))
    launch = run_torchrun(2, RUN_TP2, timeout=200)
    assert not launch.timed_out and launch.returncode == 0, launch.describe()
    assert launch.stdout == expected
    assert not launch.leftover_pids
    mp = run_checked([sys.executable, *RUN_TP2], "gpu-mp", timeout=200)  # fails on leftover processes
    assert mp.returncode == 0, mp.stderr
    assert mp.stdout == expected


@pytest.mark.gpu
@needs_2_gpus
@pytest.mark.timeout(120)
def test_launch_line_names_cuda_device_of_local_rank():
    launch = run_torchrun(2, ["-m", "spmd_engine.run", "-tp", 2, "--prompt", "Beautiful is", "--max-tokens", 4],
                          timeout=100)
    assert not launch.timed_out and launch.returncode == 0, launch.describe()
    lines = [line for line in launch.stderr.splitlines() if " launch: " in line]
    assert sorted(line.split("device=")[1].split()[0] for line in lines) == ["cuda:0", "cuda:1"], lines
