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


@pytest.mark.gpu
@needs_1_gpu
@pytest.mark.timeout(300)
def test_cuda_graphs_decode_the_bundled_text_and_after_sleep_too():
    """Decode steps replay CUDA graphs (sizes 1, 2, 4, 8: batches of 3 and 5 are padded) and write
    the bundled model's text; after sleep and wake_up (the KV cache and the weights move) the
    graphs are captured again and the text is unchanged; eager writes the same."""
    from spmd_engine import LLM, SamplingParams
    prompts = [line[:12] for line in continuation("").splitlines() if len(line) > 12][:5]
    want = [continuation(p)[:40] for p in prompts]
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    def texts(llm, batch):
        return [o.outputs[0].text for o in llm.generate(batch, sp, use_tqdm=False)]

    with LLM(max_model_len=256, max_num_seqs=8, enforce_eager=True) as eager:
        assert eager.get_stats()[0]["runner"]["cuda_graph_sizes"] == []
        assert texts(eager, prompts) == want
    # enforce_eager=False: the suite's default is eager (conftest.py), which turns graphs off too.
    # A second engine in the process: the first one's memory went back to the device.
    with LLM(max_model_len=256, max_num_seqs=8, enable_sleep_mode=True, enforce_eager=False) as llm:
        stats = llm.get_stats()[0]["runner"]
        assert stats["cuda_graph_sizes"] == [1, 2, 4, 8] and stats["cuda_graph_captures"] == 1, stats
        for n in (1, 3, 5):
            assert texts(llm, prompts[:n]) == want[:n]
        assert llm.get_stats()[0]["runner"]["cuda_graph_steps"] == 3 * 39  # every decode step
        llm.sleep(level=1)
        llm.wake_up()
        assert texts(llm, prompts[:3]) == want[:3]
        assert llm.get_stats()[0]["runner"]["cuda_graph_captures"] == 1  # the new cache's graphs
