"""scripts/bench.py still runs: the figures that reach into the engine (the runner's model,
engine requests and steps, collective_rpc, mp PP stages) in --quick mode, one rep each.

Nothing here is a timing check (timing belongs in the benchmark itself): the test asserts
that every figure is emitted once, as the JSON line docs/performance.md's tables are built
from, with positive finite numbers and the CPU model it was measured on. A figure that rots
with the engine's internals fails here, not in the next session's benchmark run (the
chunked-prefill figure once did, unseen). scripts/bench_vnni_gemm.py, the decode GEMM
kernel's benchmark, is run small for its output check."""

from __future__ import annotations

import json
import math
import sys

import pytest
from launch import REPO, run_checked

FIGURES = "decode,capacity,prefix,chunked,pp,structured,weight_transfer"
EXPECTED = {
    "decode_tokens_per_s_float32", "decode_roofline_fraction_float32", "decode_matmul_ceiling_fraction_float32",
    "decode_tokens_per_s_bfloat16", "decode_roofline_fraction_bfloat16", "decode_matmul_ceiling_fraction_bfloat16",
    "decode_roofline_fraction_bfloat16_b1", "decode_matmul_ceiling_fraction_bfloat16_b1",
    "decode_roofline_fraction_bfloat16_b32", "decode_matmul_ceiling_fraction_bfloat16_b32",
    "decode_step_over_matmuls_float32", "decode_step_over_matmuls_bfloat16",
    "decode_step_over_matmuls_bfloat16_b1", "decode_step_over_matmuls_bfloat16_b32",
    "kv_capacity_peak_running_requests", "prefix_cache_shared_prompts_tokens_per_s",
    "chunked_prefill_worst_decode_gap",
    "pp2_overlap_vs_uni_tokens_per_s", "pp2_overlap_ceiling_half_batches",
    "pp2_overlap_prefill_vs_uni_tokens_per_s", "pp2_overlap_prefill_ceiling_half_batches",
    "pp2_shm_handoff_vs_gloo_tokens_per_s", "pp2_prefill_shm_handoff_vs_gloo_tokens_per_s",
    "structured_first_request_s", "structured_json_decode_tokens_per_s_b8",
    "weight_transfer_protocol_s", "weight_transfer_push_s",
}


def figures_of(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def check_figures(figures: list[dict]) -> None:
    names = [f["name"] for f in figures]
    assert sorted(names) == sorted(EXPECTED), f"figures emitted: {sorted(names)}"
    for f in figures:
        for key in ("value", "baseline", "ratio"):
            assert isinstance(f[key], (int, float)) and math.isfinite(f[key]) and f[key] > 0, f
        assert str(f.get("params", {}).get("cpu", "")).strip(), f  # lscpu's model beside every figure


@pytest.mark.timeout(600)
def test_bench_quick_run_emits_every_figure(tmp_path):
    proc = run_checked([sys.executable, REPO / "scripts" / "bench.py", "--only", FIGURES, "--quick", "--reps", "1",
                        "--workdir", tmp_path], "bench-smoke", timeout=560)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_figures(figures_of(proc.stdout))


def test_the_figure_check_rejects_a_missing_or_broken_figure():
    """Negative controls for check_figures: one figure missing, one with a NaN ratio, one
    without the CPU it ran on."""
    good = [{"name": n, "value": 1.0, "baseline": 2.0, "ratio": 0.5, "params": {"cpu": "Some CPU [avx2]"}}
            for n in sorted(EXPECTED)]
    check_figures(good)
    with pytest.raises(AssertionError):
        check_figures(good[1:])
    with pytest.raises(AssertionError):
        check_figures(good[:-1] + [dict(good[-1], ratio=float("nan"))])
    with pytest.raises(AssertionError):  # a figure that says nothing of its machine
        check_figures(good[:-1] + [dict(good[-1], params={})])


@pytest.mark.timeout(300)
def test_the_decode_gemm_kernel_builds_and_its_outputs_check_out():
    """scripts/bench_vnni_gemm.py finds the engine's AVX512-BF16 kernel (and its AMX path) and checks every output
    against an fp32 matmul before it times anything; one small run here, where it can run."""
    from spmd_engine.kernels import vnni_gemm
    if vnni_gemm.unavailable() is not None:
        pytest.skip(f"the kernel is unavailable here: {vnni_gemm.unavailable()}")
    proc = run_checked([sys.executable, REPO / "scripts" / "bench_vnni_gemm.py", "--rows", "1,3,8,11", "--threads", "1",
                        "--reps", "1", "--pool-mib", "4"], "vnni-gemm", timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = figures_of(proc.stdout)
    paths = 2 if vnni_gemm._tiles_tried() else 1  # the AMX path is timed too where it exists
    # 5 matrices x 4 row counts, 4 step sums, for each path
    assert len(figures) == (5 * 4 + 4) * paths, [f["name"] for f in figures]
    assert all(math.isfinite(f["ratio"]) and f["ratio"] > 0 for f in figures)
