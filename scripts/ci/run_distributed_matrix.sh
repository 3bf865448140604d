#!/usr/bin/env bash
# The distributed test matrix for a CI job, on a GPU runner or a CPU one.
#
#   scripts/ci/run_distributed_matrix.sh [extra pytest args...]
#
# Without GPUs: every test except those marked `gpu`, on gloo, WORKERS at a time.
# With GPUs (torch.cuda.device_count() > 0, or nvidia-smi when torch cannot tell):
#   1. the same matrix with the GPUs hidden (CUDA_VISIBLE_DEVICES=""), so launches that size
#      themselves for CPUs (worlds of up to 8 on gloo) never fight over devices;
#   2. the `gpu` tests, one at a time, with every GPU visible: NCCL groups, TP runs on cuda.
# Every test is bounded by pytest-timeout (TEST_TIMEOUT seconds unless the test sets its own),
# and the launch helpers kill what a test leaves behind.
#
# Environment (all optional):
#   PYTHON        interpreter with spmd_engine[test] installed (default: .venv/bin/python, else python3)
#   TESTS         test paths (default: tests)
#   WORKERS       pytest-xdist workers for the CPU matrix (default: 2)
#   TEST_TIMEOUT  per-test limit in seconds (default: 600)
#   FORCE_CPU=1   treat the runner as having no GPU
set -euo pipefail
cd "$(dirname "$0")/../.."

if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
TESTS=${TESTS:-tests}
WORKERS=${WORKERS:-2}
TEST_TIMEOUT=${TEST_TIMEOUT:-600}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

gpu_count() {
    local n
    n=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' \
        2>/dev/null || echo 0)
    if [[ "$n" == 0 ]] && command -v nvidia-smi >/dev/null 2>&1; then
        local listed
        listed=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
        if (( listed > 0 )); then
            echo "warning: nvidia-smi lists $listed GPU(s) but this torch sees none (a CPU-only build?)" >&2
        fi
    fi
    echo "$n"
}

GPUS=0
[[ "${FORCE_CPU:-0}" == 1 ]] || GPUS=$(gpu_count)
# shellcheck disable=SC2206  # TESTS is a list of paths
TEST_PATHS=($TESTS)
status=0

if (( GPUS == 0 )); then
    echo "== distributed matrix: no GPU, gloo, $WORKERS workers, ${TEST_TIMEOUT}s per test" >&2
    "$PYTHON" -m pytest -n "$WORKERS" -m "not gpu" --timeout "$TEST_TIMEOUT" "${TEST_PATHS[@]}" "$@" || status=$?
    exit "$status"
fi

echo "== distributed matrix: $GPUS GPU(s); CPU matrix on gloo with GPUs hidden, $WORKERS workers" >&2
CUDA_VISIBLE_DEVICES="" "$PYTHON" -m pytest -n "$WORKERS" -m "not gpu" --timeout "$TEST_TIMEOUT" \
    "${TEST_PATHS[@]}" "$@" || status=$?

echo "== gpu tests: NCCL on $GPUS GPU(s), one test at a time, ${TEST_TIMEOUT}s per test" >&2
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
gpu_status=0
"$PYTHON" -m pytest -m gpu -rs --timeout "$TEST_TIMEOUT" "${TEST_PATHS[@]}" "$@" || gpu_status=$?
if (( gpu_status == 5 )); then  # pytest: no test collected
    echo "error: GPUs present but no gpu test was collected from ${TESTS}" >&2
fi
(( status == 0 )) && status=$gpu_status
exit "$status"
