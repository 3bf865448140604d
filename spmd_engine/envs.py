"""Every SPMD_ENGINE_* environment variable (and vLLM's VLLM_BATCH_INVARIANT), read and checked in
one place.

A variable is read when its function is called (not at import), so a test or a
launcher can set it late; a bad value is a ConfigError naming the variable, the
same wherever it is read. Each function takes `environ` so callers can pass
another mapping (a worker's, a test's).
"""

from __future__ import annotations

import os
from typing import Mapping

from spmd_engine.config import ConfigError

TIMEOUT_S = "SPMD_ENGINE_TIMEOUT_S"
PP_PARTITION = "SPMD_ENGINE_PP_PARTITION"
DP_WAVES = "SPMD_ENGINE_DP_WAVES"
WORKER_MULTIPROC_METHOD = "SPMD_ENGINE_WORKER_MULTIPROC_METHOD"
CPU_PACKED_WEIGHTS = "SPMD_ENGINE_CPU_PACKED_WEIGHTS"
CPU_BF16_GEMM = "SPMD_ENGINE_CPU_BF16_GEMM"
CPU_FP32_GEMM = "SPMD_ENGINE_CPU_FP32_GEMM"
CPU_DECODE_ATTENTION = "SPMD_ENGINE_CPU_DECODE_ATTENTION"
DISABLE_SHM_ALLREDUCE = "SPMD_ENGINE_DISABLE_SHM_ALLREDUCE"
DISABLE_SHM_HANDOFF = "SPMD_ENGINE_DISABLE_SHM_HANDOFF"
CPU_BF16 = "SPMD_ENGINE_CPU_BF16"
CPU_FP16 = "SPMD_ENGINE_CPU_FP16"
ENFORCE_EAGER = "SPMD_ENGINE_ENFORCE_EAGER"

BATCH_INVARIANT = "VLLM_BATCH_INVARIANT"  # vLLM's name, so its users' habit carries over

DEFAULT_TIMEOUT_S = 300.0


def timeout_s(environ: Mapping[str, str] = os.environ) -> float:
    """Limit of every collective and worker call, in seconds (default 300)."""
    raw = environ.get(TIMEOUT_S)
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{TIMEOUT_S}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ConfigError(f"{TIMEOUT_S} must be > 0, got {raw}")
    return value


def pp_partition(environ: Mapping[str, str] = os.environ) -> str | None:
    """Layers per PP stage, e.g. "3,3,2" (checked against the model where it is used)."""
    return environ.get(PP_PARTITION) or None


def dp_waves(environ: Mapping[str, str] = os.environ) -> str:
    """'auto' (waves for a mixture of experts under DP) or '1' (always, under DP)."""
    forced = environ.get(DP_WAVES, "auto")
    if forced not in ("auto", "1"):
        raise ConfigError(f"{DP_WAVES}={forced!r}: expected 'auto' or '1'")
    return forced


def worker_multiproc_method(environ: Mapping[str, str] = os.environ) -> str:
    """How mp workers and DP engine cores are started (default spawn, as vLLM)."""
    return environ.get(WORKER_MULTIPROC_METHOD, "spawn")


def cpu_packed_weights(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether CPU linear weights may be packed for oneDNN ("0" turns it off)."""
    return environ.get(CPU_PACKED_WEIGHTS, "1") != "0"


def cpu_bf16_gemm(environ: Mapping[str, str] = os.environ) -> str:
    """Which kernel packed bf16 linear weights are for on CPU: "auto" (default: the AVX512-BF16
    kernel of kernels/vnni_gemm.py where it builds and checks out, with its AMX tiles where
    the CPU and the OS allow them, else oneDNN), "onednn", "vnni" (that kernel, AMX tiles where
    allowed, or an error saying why not), or "avx512" (that kernel without its AMX tiles)."""
    raw = environ.get(CPU_BF16_GEMM, "auto") or "auto"
    if raw not in ("auto", "onednn", "vnni", "avx512"):
        raise ConfigError(f"{CPU_BF16_GEMM}={raw!r}: expected 'auto', 'onednn', 'vnni' or 'avx512'")
    return raw


def cpu_fp32_gemm(environ: Mapping[str, str] = os.environ) -> str:
    """Which kernel packed fp32 linear weights are for on CPU: "auto" (default: the fp32 path of
    kernels/vnni_gemm.py's kernel where it builds and checks out, else oneDNN), "onednn", or
    "vnni" (that kernel, or an error saying why not)."""
    raw = environ.get(CPU_FP32_GEMM, "auto") or "auto"
    if raw not in ("auto", "onednn", "vnni"):
        raise ConfigError(f"{CPU_FP32_GEMM}={raw!r}: expected 'auto', 'onednn' or 'vnni'")
    return raw


def cpu_decode_attention(environ: Mapping[str, str] = os.environ) -> str:
    """How decode-shaped steps attend on CPU: "auto" (default: the kernel of
    kernels/decode_attention.py where it builds and checks out, else torch code), "torch"
    (torch code: SDPA eager, traced loops compiled), or "kernel" (an error where it cannot)."""
    raw = environ.get(CPU_DECODE_ATTENTION, "auto") or "auto"
    if raw not in ("auto", "torch", "kernel"):
        raise ConfigError(f"{CPU_DECODE_ATTENTION}={raw!r}: expected 'auto', 'torch' or 'kernel'")
    return raw


def enforce_eager(environ: Mapping[str, str] = os.environ) -> bool:
    """The default of enforce_eager when an engine leaves it unset: "1" runs eager (the test
    suite sets it: compiling in each of its hundreds of engines would cost minutes)."""
    raw = environ.get(ENFORCE_EAGER, "0")
    if raw not in ("0", "1"):
        raise ConfigError(f"{ENFORCE_EAGER}={raw!r}: expected '0' or '1'")
    return raw == "1"


def cpu_bf16(environ: Mapping[str, str] = os.environ) -> bool | None:
    """Whether `--dtype auto` may treat this CPU as running bf16 natively: "1" pretends it
    has AVX512-BF16 or AMX-BF16, "0" that it has neither; unset or "auto" detects it."""
    return _switch(CPU_BF16, environ)


def cpu_fp16(environ: Mapping[str, str] = os.environ) -> bool | None:
    """The same for fp16 (AMX-FP16)."""
    return _switch(CPU_FP16, environ)


def _switch(name: str, environ: Mapping[str, str]) -> bool | None:
    raw = environ.get(name, "auto")
    if raw not in ("", "auto", "0", "1"):
        raise ConfigError(f"{name} must be auto, 0 or 1, got {raw!r}")
    return None if raw in ("", "auto") else raw == "1"


def shm_allreduce_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """The shared-memory all-reduce/all-gather's switch (anything but "" or "0" turns it off;
    the platform is checked where it is set up)."""
    return environ.get(DISABLE_SHM_ALLREDUCE, "0") in ("", "0")


def shm_handoff_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """The shared-memory PP hand-off's own switch, as the all-reduce's."""
    return environ.get(DISABLE_SHM_HANDOFF, "0") in ("", "0")


def local_world_size(default: int, environ: Mapping[str, str] = os.environ) -> int:
    """Processes of this job on this host: the launcher's LOCAL_WORLD_SIZE, else `default`."""
    return int(environ.get("LOCAL_WORLD_SIZE", default))


def restart_attempt(environ: Mapping[str, str] = os.environ) -> int:
    """torchrun's restart attempt (TORCHELASTIC_RESTART_COUNT), 0 for the first."""
    return int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def batch_invariant(environ: Mapping[str, str] = os.environ) -> bool:
    """VLLM_BATCH_INVARIANT=1 turns batch-invariant mode on (as in vLLM); 0 or unset leaves it off."""
    raw = environ.get(BATCH_INVARIANT, "0")
    if raw not in ("", "0", "1"):
        raise ConfigError(f"{BATCH_INVARIANT} must be 0 or 1, got {raw!r}")
    return raw == "1"
