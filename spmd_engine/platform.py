"""The machine the engine runs on: this CPU's instruction-set flags, whether it runs a half type
natively, and so the dtype the engine runs in. The CPU kernels and the loader both read it; it
imports nothing of the model.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Mapping

import torch

from spmd_engine import envs
from spmd_engine.config import ConfigError

DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "half": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, hf_config: dict[str, Any],
                  device: str | torch.device) -> torch.dtype:
    """The dtype the engine runs in (choose_dtype's, without the reason)."""
    return choose_dtype(dtype, hf_config, device)[0]


def choose_dtype(dtype: str | torch.dtype | None, hf_config: dict[str, Any], device: str | torch.device,
                 environ: Mapping[str, str] = os.environ) -> tuple[torch.dtype, str]:
    """(dtype, the start-up line saying why). An explicit dtype wins. `auto` (or None) is the
    checkpoint's own dtype on accelerators; on CPU it is the checkpoint's half type only where
    the CPU runs it natively (cpu_native_half), else float32: emulated (AVX2) bf16 matmuls are
    slower than fp32's, and fp16 without AMX-FP16 no faster (docs/running.md, "On CPU")."""
    if isinstance(dtype, torch.dtype):
        return dtype, f"dtype {_name(dtype)} (explicit)"
    if dtype not in (None, "auto"):
        if dtype not in DTYPES:
            raise ConfigError(f"unsupported dtype {dtype!r} (choose from {', '.join(sorted(DTYPES))}, auto)")
        return DTYPES[dtype], f"dtype {_name(DTYPES[dtype])} (explicit)"
    named = hf_config.get("torch_dtype") or hf_config.get("dtype")
    configured = DTYPES.get(str(named or "float32").replace("torch.", ""), torch.float32)
    source = f"checkpoint {_name(configured)}" if named else "config.json names no dtype"
    kind = torch.device(device).type
    if kind != "cpu" or configured == torch.float32:
        chosen, why = configured, source if kind == "cpu" else f"{source}, on {kind}"
    else:
        native, reason = cpu_native_half(configured, environ)
        chosen, why = configured if native else torch.float32, f"{source}, {reason}"
    return chosen, f"dtype auto -> {_name(chosen)} ({why})"


# The instructions (cpuinfo's and /proc/cpuinfo's flag names) that run each half type natively.
NATIVE_HALF = {torch.bfloat16: {"avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX-BF16"},
               torch.float16: {"amx_fp16": "AMX-FP16"}}


def cpu_native_half(dtype: torch.dtype, environ: Mapping[str, str] = os.environ) -> tuple[bool, str]:
    """Whether this CPU runs `dtype` (bf16 or fp16) natively, and why, for the log line:
    "CPU has AVX512-BF16, AMX-BF16", "CPU has no AVX512-BF16 or AMX-BF16: ...", or the override
    ("SPMD_ENGINE_CPU_BF16=0" or "=1"). Native means one of NATIVE_HALF's instructions and a
    torch with oneDNN (whose kernels use them)."""
    name, forced = (envs.CPU_BF16, envs.cpu_bf16(environ)) if dtype == torch.bfloat16 else \
        (envs.CPU_FP16, envs.cpu_fp16(environ))
    if forced is not None:
        return forced, f"{name}={int(forced)}"
    wanted = NATIVE_HALF[dtype]
    have = [label for flag, label in wanted.items() if flag in cpu_flags()]
    if have and torch.backends.mkldnn.is_available():
        return True, "CPU has " + ", ".join(have)
    if have:
        return False, "CPU has " + ", ".join(have) + ", but this torch has no oneDNN"
    return False, "CPU has no " + " or ".join(wanted.values()) + ": float32 is faster"


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """This CPU's instruction-set flags: torch's cpuinfo (torch.cpu.get_capabilities, any OS),
    else Linux's /proc/cpuinfo, else none."""
    get = getattr(torch.cpu, "get_capabilities", None)
    if get is not None:
        try:
            return frozenset(flag for flag, value in get().items() if value is True)
        except (RuntimeError, AttributeError):
            pass
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
