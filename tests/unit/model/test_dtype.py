"""`dtype auto` (platform.choose_dtype): the checkpoint's own dtype on accelerators; on CPU its
bf16 (fp16) only where the CPU runs that natively, else float32; an explicit dtype always wins.
SPMD_ENGINE_CPU_BF16 / _FP16 pretend the capability present (1) or absent (0), so both
branches run on any machine; the plan resolves the same dtype as the engine."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import sys

import pytest
import torch
from engine_helpers import make_tiny_checkpoint

from spmd_engine.config import ConfigError
from spmd_engine.engine.arg_utils import EngineArgs
from spmd_engine.model import load_model
from spmd_engine.model.solo import SoloGroup
from spmd_engine.plan.main import main as plan_main
from spmd_engine.platform import choose_dtype, cpu_flags, cpu_native_half, resolve_dtype

BF16, FP16, FP32 = {"torch_dtype": "bfloat16"}, {"dtype": "float16"}, {"torch_dtype": "float32"}


def env(bf16: str | None = None, fp16: str | None = None) -> dict[str, str]:
    out = {}
    if bf16 is not None:
        out["SPMD_ENGINE_CPU_BF16"] = bf16
    if fp16 is not None:
        out["SPMD_ENGINE_CPU_FP16"] = fp16
    return out


def test_bf16_checkpoint_on_cpu_follows_the_capability():
    assert choose_dtype(None, BF16, "cpu", env(bf16="1")) == (
        torch.bfloat16, "dtype auto -> bfloat16 (checkpoint bfloat16, SPMD_ENGINE_CPU_BF16=1)")
    assert choose_dtype("auto", BF16, "cpu", env(bf16="0")) == (
        torch.float32, "dtype auto -> float32 (checkpoint bfloat16, SPMD_ENGINE_CPU_BF16=0)")


def test_fp16_checkpoint_on_cpu_needs_amx_fp16_not_bf16():
    assert choose_dtype(None, FP16, "cpu", env(fp16="1"))[0] == torch.float16
    assert choose_dtype(None, FP16, "cpu", env(bf16="1", fp16="0"))[0] == torch.float32
    assert choose_dtype(None, BF16, "cpu", env(bf16="0", fp16="1"))[0] == torch.float32


def test_fp32_checkpoint_stays_fp32():
    for config in (FP32, {}, {"torch_dtype": "torch.float32"}):
        for bf16 in ("0", "1"):
            assert choose_dtype(None, config, "cpu", env(bf16=bf16, fp16=bf16))[0] == torch.float32
    assert choose_dtype(None, {}, "cpu")[1] == "dtype auto -> float32 (config.json names no dtype)"


@pytest.mark.parametrize("given, want", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                         ("float16", torch.float16), (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("capable", ["0", "1"])
def test_an_explicit_dtype_wins(given, want, capable):
    for config in (BF16, FP16, FP32):
        for device in ("cpu", "cuda"):
            got = choose_dtype(given, config, device, env(bf16=capable, fp16=capable))
            assert got == (want, f"dtype {str(want)[6:]} (explicit)")


def test_accelerators_keep_the_checkpoint_dtype():
    for config, want in ((BF16, torch.bfloat16), (FP16, torch.float16), (FP32, torch.float32)):
        assert choose_dtype(None, config, "cuda", env(bf16="0", fp16="0"))[0] == want
    assert choose_dtype(None, BF16, "cuda:1")[1] == "dtype auto -> bfloat16 (checkpoint bfloat16, on cuda)"


def test_bad_override_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match="SPMD_ENGINE_CPU_BF16 must be auto, 0 or 1, got 'yes'"):
        choose_dtype(None, BF16, "cpu", env(bf16="yes"))
    assert choose_dtype(None, BF16, "cpu", env(bf16="auto")) == choose_dtype(None, BF16, "cpu", {})


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/cpuinfo")
def test_detection_matches_the_kernels_cpu_flags():
    with open("/proc/cpuinfo") as f:
        flags = set(next(line for line in f if line.startswith("flags")).split(":")[1].split())
    for flag in ("avx512_bf16", "amx_bf16", "amx_fp16"):
        assert (flag in cpu_flags()) == (flag in flags), flag
    native, why = cpu_native_half(torch.bfloat16, {})
    assert native == bool(flags & {"avx512_bf16", "amx_bf16"} and torch.backends.mkldnn.is_available())
    assert why.startswith("CPU has AVX512-BF16" if "avx512_bf16" in flags else
                          "CPU has AMX-BF16" if "amx_bf16" in flags else "CPU has no AVX512-BF16 or AMX-BF16")
    want = torch.bfloat16 if native else torch.float32
    assert choose_dtype(None, BF16, "cpu", {}) == (want, f"dtype auto -> {str(want)[6:]} (checkpoint bfloat16, {why})")


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("bf16"), dtype="bfloat16")


def plan_json(model, *flags) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert plan_main(["--model", str(model), "--json", "--kv-cache-memory-bytes", str(1 << 20), *flags]) == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize("capable, want", [("1", torch.bfloat16), ("0", torch.float32)])
def test_engine_and_plan_resolve_the_same_dtype(bf16_ckpt, monkeypatch, caplog, capable, want):
    monkeypatch.setenv("SPMD_ENGINE_CPU_BF16", capable)
    solo = SoloGroup()
    assert load_model(bf16_ckpt, solo, solo).dtype == want
    with caplog.at_level(logging.INFO, logger="spmd_engine"):
        setup = EngineArgs(model=str(bf16_ckpt), device="cpu").create_engine_config()
    line = f"dtype auto -> {str(want)[6:]} (checkpoint bfloat16, SPMD_ENGINE_CPU_BF16={capable})"
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("dtype ")] == [line]
    assert resolve_dtype(setup.config.model_config.dtype, setup.inputs.hf_config, setup.config.device) == want
    plan = plan_json(bf16_ckpt)
    assert (plan["kv_cache"]["dtype"], plan["memory"]["dtype"], plan["kv_cache"]["dtype_line"]) == (
        str(want)[6:], str(want)[6:], line)
    # TINY: 4 layers x 2 KV heads x 8 dims x K,V, in the chosen dtype's bytes.
    assert plan["kv_cache"]["bytes_per_token"] == 4 * 2 * 8 * 2 * want.itemsize
    assert plan_json(bf16_ckpt, "--dtype", "float32")["kv_cache"]["dtype"] == "float32"  # explicit wins

