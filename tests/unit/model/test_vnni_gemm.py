"""The AVX512-BF16 decode GEMM (spmd_engine/kernels/vnni_gemm.py, kernels/vnni_gemm.cpp),
and its fp32 path (the same layout with one k per line): summed in fp32 in k order per row.

The kernel computes what an fp32 matmul of the same bf16 values computes, rounded to bf16, on
every tile path (groups of 1-4 column blocks, 6-row tiles, 1-5 row tails, bias); a row's bits
do not depend on the rows beside it; a model packed for it gives oneDNN's logits and follows
every weight update; where it cannot be built or disagrees, weights stay with oneDNN, unless
SPMD_ENGINE_CPU_BF16_GEMM=vnni asks for it, which is then an error saying why. The kernel's
tests skip on CPUs without AVX512-BF16 (or without g++); the fallback's run everywhere. A CPU
with AVX-512 but without BF16 gets the fp32 path alone (a build for one, made here).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fake_groups import SoloGroup
from launch import REPO
from model_helpers import LLAMA, QWEN_TIED, make_random_checkpoint, run_schedule

from spmd_engine import envs
from spmd_engine.config import ConfigError
from spmd_engine.kernels import packed_weights, vnni_gemm
from spmd_engine.model import load_model

REASON = vnni_gemm.unavailable()
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"the kernel is unavailable here: {REASON}")


@pytest.fixture
def fresh_availability(monkeypatch):
    """unavailable() is cached per process: clear it around a test that changes its answer."""
    vnni_gemm.unavailable.cache_clear()
    yield
    monkeypatch.undo()
    vnni_gemm.unavailable.cache_clear()


@pytest.fixture(params=["avx512", "amx"])
def kernel_path(request):
    """Each test once on the AVX-512 path and once with the AMX tiles on (where they are: a CPU
    with AMX, a build for it, an OS that grants the tile state); the process's choice put back."""
    if request.param == "amx" and not vnni_gemm._tiles_tried():
        pytest.skip("no AMX path here (CPU, build or OS)")
    was = vnni_gemm.amx_in_use()
    vnni_gemm._use_tiles(request.param == "amx")
    yield request.param
    vnni_gemm._use_tiles(was)


@needs_kernel
@pytest.mark.parametrize("n,k", [(16, 2), (48, 40), (64, 512), (32, 1536), (48, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_equals_an_fp32_matmul_rounded_once(n, k, bias, kernel_path):
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    packed = vnni_gemm.pack(w)
    for m in (0, 1, 2, 7, 8, 9, 15, 16, 17, 31, 33):
        x = torch.randn(m, k, generator=gen).bfloat16()
        got = packed_weights.linear(x, packed, b)
        want = F.linear(x.double(), w.double(), None if b is None else b.double())
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        # fp32 sums in another order, then one rounding to bf16 (2^-8 relative)
        torch.testing.assert_close(got.double(), want, rtol=2 ** -7, atol=1e-5 * k ** 0.5, msg=f"{m} rows")


@pytest.fixture(params=["bf16-avx512", "bf16-amx", "fp32"])
def dtype_and_path(request):
    """The kernel's paths: bf16 on AVX-512 and on AMX tiles (where there are tiles), and fp32
    (which has no tile path); yields the dtype, the tile choice set and put back."""
    if request.param == "bf16-amx" and not vnni_gemm._tiles_tried():
        pytest.skip("no AMX path here (CPU, build or OS)")
    was = vnni_gemm.amx_in_use()
    vnni_gemm._use_tiles(request.param == "bf16-amx")
    yield torch.float32 if request.param == "fp32" else torch.bfloat16
    vnni_gemm._use_tiles(was)


@needs_kernel
@pytest.mark.parametrize("n,k", [(16, 1), (48, 41), (64, 512), (32, 1536), (3072, 512)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_fp32_path_equals_a_double_matmul(n, k, bias):
    """Every tile shape (groups of 1-4 blocks, 6-row tiles, 1-5 row tails, the prefetching first
    tile) and odd K, which the bf16 path cannot take."""
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    packed = vnni_gemm.pack(w)
    assert packed.shape == (n // 16, k, 16, 1)
    for m in (0, 1, 2, 5, 6, 7, 12, 16, 17, 33):
        x = torch.randn(m, k, generator=gen)
        got = packed_weights.linear(x, packed, b)
        want = F.linear(x.double(), w.double(), None if b is None else b.double())
        assert got.dtype == torch.float32 and got.shape == (m, n)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * k ** 0.5, msg=f"{m} rows")


@needs_kernel
def test_a_rows_bits_do_not_depend_on_the_batch_it_came_in(dtype_and_path):
    dtype = dtype_and_path
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(112, 1536, generator=gen).to(dtype), torch.randn(112, generator=gen).to(dtype)
    packed = vnni_gemm.pack(w)
    x = torch.randn(37, 1536, generator=gen).to(dtype)
    batch = vnni_gemm.linear(x, packed, b)
    for r in range(37):
        assert torch.equal(vnni_gemm.linear(x[r:r + 1], packed, b)[0], batch[r]), r
    assert torch.equal(vnni_gemm.linear(x[3:12], packed, b), batch[3:12])  # 8 + 1 rows
    assert torch.equal(vnni_gemm.linear(x[2:19], packed, b), batch[2:19])  # 17 rows: an overlapping chunk


@needs_kernel
def test_the_amx_path_leaves_other_tile_users_their_configuration():
    """oneDNN's bf16 matmuls use the same tiles on an AMX CPU and may keep track of the
    configuration they loaded: calls of theirs between the kernel's, on the same threads, still
    give their own results."""
    if not vnni_gemm._tiles_tried():
        pytest.skip("no AMX path here (CPU, build or OS)")
    was = vnni_gemm.amx_in_use()
    vnni_gemm._use_tiles(True)
    try:
        gen = torch.Generator().manual_seed(2)
        w = torch.randn(256, 512, generator=gen).bfloat16()
        onednn, ours = torch.ops.mkldnn._reorder_linear_weight(w, 32), vnni_gemm.pack(w)
        xs = [torch.randn(m, 512, generator=gen).bfloat16() for m in (32, 5, 64, 16)]
        alone = [packed_weights.linear(x, onednn) for x in xs], [vnni_gemm.linear(x, ours) for x in xs]
        for _ in range(3):
            for i, x in enumerate(xs):
                assert torch.equal(packed_weights.linear(x, onednn), alone[0][i]), i
                assert torch.equal(vnni_gemm.linear(x, ours), alone[1][i]), i
    finally:
        vnni_gemm._use_tiles(was)


def test_pack_and_unpack_are_inverse_and_the_layout_is_told_by_the_shape():
    w = torch.randn(48, 40).bfloat16()
    packed = vnni_gemm.pack(w)
    assert packed.shape == (3, 20, 16, 2) and vnni_gemm.dense_shape(packed) == (48, 40)
    assert packed[1, 7, 5].tolist() == w[16 + 5, 14:16].tolist()  # block 1, k pair 7, column 5
    assert torch.equal(vnni_gemm.unpack(packed), w)
    assert packed_weights.layout(packed) == "vnni" and packed_weights.layout(w) == "dense"
    assert torch.equal(packed_weights.dense_weight(packed), w)
    assert packed_weights.dense_shape(packed) == (48, 40)
    assert not vnni_gemm.fits(40, 48) and not vnni_gemm.fits(48, 41) and vnni_gemm.fits(48, 40)
    w32 = torch.randn(48, 41)
    packed = vnni_gemm.pack(w32)
    assert packed.shape == (3, 41, 16, 1) and vnni_gemm.dense_shape(packed) == (48, 41)
    assert packed[1, 7, 5, 0].item() == w32[16 + 5, 7].item()  # block 1, k 7, column 5
    assert torch.equal(vnni_gemm.unpack(packed), w32) and packed_weights.layout(packed) == "vnni"
    assert vnni_gemm.fits(48, 41, torch.float32) and not vnni_gemm.fits(40, 48, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_written_in_place_are_the_bytes_packing_the_whole_weight_gives(dtype):
    """An update writes a packed weight by row ranges (PackedRows, as the loaders slice a fused
    weight): whole blocks of 16, ranges that cut a block, strided and other-dtype sources, and a
    zeroed range must all leave exactly what `pack` of the updated dense weight holds."""
    from spmd_engine.kernels.packed_rows import PackedRows
    gen = torch.Generator().manual_seed(7)
    want = torch.randn(64, 40, generator=gen).to(dtype)
    packed = vnni_gemm.pack(want)
    storage = packed.data_ptr()
    rows = PackedRows(packed)
    assert rows.shape == (64, 40) and rows[16:48].shape == (32, 40)
    new = torch.randn(64, 40, generator=gen).to(dtype)
    rows[16:48].copy_(new[16:48])  # whole blocks
    want[16:48] = new[16:48]
    rows[3:21].copy_(new[3:21].float())  # cuts blocks 0 and 1, from fp32
    want[3:21] = new[3:21]
    wide = torch.randn(64, 80, generator=gen).to(dtype)[:, ::2]  # a strided source
    rows[48:][:16].copy_(wide[48:])
    want[48:] = wide[48:]
    transposed = torch.randn(40, 16, generator=gen).to(dtype).t()  # rows not contiguous at all
    rows[0:16].copy_(transposed)
    want[0:16] = transposed
    rows[40:45].zero_()
    want[40:45] = 0
    assert torch.equal(packed, vnni_gemm.pack(want)) and packed.data_ptr() == storage
    with pytest.raises(ValueError, match="shape"):
        rows[0:16].copy_(new[0:8])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_whole_blocks_from_fp32_round_as_torch_converts(dtype):
    """A transfer's fp32 tensors into a bf16 or fp32 engine (and bf16 ones): whole blocks are
    converted and packed in one pass (write_blocks where the library loads), and must hold the
    bits `pack(src.to(dtype))` does: round to nearest even at ties, infinities and signed zeros
    kept, NaN still NaN."""
    from spmd_engine.kernels.packed_rows import PackedRows
    gen = torch.Generator().manual_seed(3)
    src = torch.randn(48, 64, generator=gen) * 1000
    ties = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 2 ** -130, float("inf"), -0.0])
    src[0, :6] = ties  # exactly halfway between two bf16 values: even wins (and a denormal)
    src[1, 0] = float("nan")  # row 17 of the weight
    src[1, 1] = torch.tensor([0x7F800001], dtype=torch.int32).view(torch.float32)  # a NaN rounding alone would make inf
    packed = vnni_gemm.pack(torch.zeros(64, 64, dtype=dtype))
    PackedRows(packed)[16:64].copy_(src)
    halves = torch.randn(16, 64, generator=gen).to(torch.bfloat16)  # and a bf16 source: copied or widened
    PackedRows(packed)[0:16].copy_(halves)
    want = torch.zeros(64, 64, dtype=dtype)
    want[16:] = src.to(dtype)
    want[:16] = halves.to(dtype)
    got = vnni_gemm.unpack(packed)
    assert torch.isnan(got[17, :2]).all() and torch.isnan(want[17, :2]).all()
    got[17, :2] = want[17, :2] = 0
    assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def logits_of(path, layout: str, monkeypatch) -> list[np.ndarray]:
    monkeypatch.setenv(envs.CPU_BF16_GEMM, layout)
    model = load_model(path, SoloGroup(), SoloGroup(), dtype=torch.bfloat16)
    packed_weights.pack_linear_weights(model, batch_hint=8)
    layouts = {packed_weights.layout(m.weight) for m in model.modules() if getattr(m, "packable_weight", False)}
    assert layout in layouts, layouts  # the LM heads of these vocabularies (not 16s) stay oneDNN
    with torch.no_grad():
        return [x.astype(np.float64) for x in run_schedule(model)]


@needs_kernel
@pytest.mark.parametrize("arch", [LLAMA, QWEN_TIED], ids=["llama", "qwen_biased_tied"])
def test_a_model_packed_for_the_kernel_gives_onednns_logits(tmp_path, arch, monkeypatch):
    path = make_random_checkpoint(tmp_path / "m", **arch, dtype="bfloat16")
    theirs, ours = logits_of(path, "onednn", monkeypatch), logits_of(path, "vnni", monkeypatch)
    for step, (a, b) in enumerate(zip(theirs, ours)):
        # bitwise here (K <= 128); in general they may differ in summation order only
        np.testing.assert_allclose(b, a, rtol=2e-2, atol=2e-2, err_msg=f"step {step}")
        assert np.array_equal(a, b), f"step {step}: {np.abs(a - b).max()}"


@needs_kernel
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_packed_weights_follow_an_update_a_discard_and_a_reload(tmp_path, dtype, monkeypatch):
    """A trainer's update writes into the unpacked weight and packs it again; a discarded
    (sleep level 2) weight is allocated in the kernel's layout again: stale weights would be
    served otherwise."""
    from safetensors.torch import load_file
    monkeypatch.setenv(envs.CPU_BF16_GEMM, "vnni")
    monkeypatch.setenv(envs.CPU_FP32_GEMM, "vnni")
    first = make_random_checkpoint(tmp_path / "a", **LLAMA, dtype=dtype)
    second = make_random_checkpoint(tmp_path / "b", **LLAMA, dtype=dtype, seed=5)

    def packed(path):
        model = load_model(path, SoloGroup(), SoloGroup(), dtype=getattr(torch, dtype))
        packed_weights.pack_linear_weights(model, batch_hint=8)
        return model

    def logits(model):
        with torch.no_grad():
            return np.concatenate([x.ravel() for x in run_schedule(model)])

    model, want = packed(first), logits(packed(second))
    before = logits(model)
    assert not np.array_equal(before, want)
    model.update_weights(load_file(str(second / "model.safetensors")).items())
    assert packed_weights.layout(next(iter(model.model.layers.values())).mlp.down_proj.weight) == "vnni"
    assert np.array_equal(logits(model), want)
    model.discard_weights()
    model.allocate_discarded_weights()
    assert packed_weights.layout(next(iter(model.model.layers.values())).mlp.down_proj.weight) == "vnni"
    model.update_weights(load_file(str(first / "model.safetensors")).items())
    assert np.array_equal(logits(model), before)


def test_the_choice_of_kernel_and_its_errors(monkeypatch, fresh_availability):
    monkeypatch.setenv(envs.CPU_BF16_GEMM, "onednn")
    assert not vnni_gemm.wanted()
    monkeypatch.setenv(envs.CPU_BF16_GEMM, "mkl")
    with pytest.raises(ConfigError, match="SPMD_ENGINE_CPU_BF16_GEMM='mkl': expected 'auto', 'onednn', 'vnni' or 'avx512'"):
        vnni_gemm.wanted()
    from spmd_engine import platform
    monkeypatch.setattr(platform, "cpu_flags", lambda: frozenset({"avx2", "avx512_f"}))
    monkeypatch.setenv(envs.CPU_BF16_GEMM, "auto")
    assert not vnni_gemm.wanted()  # auto: oneDNN, quietly
    monkeypatch.setenv(envs.CPU_BF16_GEMM, "vnni")
    with pytest.raises(ConfigError, match="the kernel is unavailable: this CPU lacks avx512_bw, avx512_vl, avx512_bf16"):
        vnni_gemm.wanted()


def test_a_kernel_that_fails_to_build_or_disagrees_leaves_weights_to_onednn(tmp_path, monkeypatch,
                                                                             fresh_availability):
    if shutil.which("g++") is None:
        pytest.skip("no g++ to fail a build with")
    from spmd_engine import platform
    monkeypatch.setattr(platform, "cpu_flags", lambda: frozenset(
        f for names in vnni_gemm.NEEDED_FLAGS + vnni_gemm.BF16_FLAGS for f in names))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(vnni_gemm, "SOURCE", broken)
    reason = vnni_gemm.unavailable()
    assert reason is not None and reason.startswith("building, loading or trying it failed (RuntimeError: g++ exited with 1: "), reason
    assert "broken.cpp" in reason and "error" in reason, reason  # the compiler's own first error
    assert not list((tmp_path / "cache").rglob("*.so"))  # nothing half-built left to load
    monkeypatch.setenv(envs.CPU_BF16_GEMM, "auto")
    weight = torch.randn(32, 64).bfloat16()
    assert packed_weights._layout_for(weight, batch_invariant=False) == "onednn"
    if REASON is None:  # the real kernel, wrong: a trial that disagrees
        monkeypatch.undo()
        vnni_gemm.unavailable.cache_clear()
        monkeypatch.setattr(vnni_gemm, "linear", lambda x, packed, bias=None: torch.zeros(
            x.shape[0], packed.shape[0] * 16, dtype=x.dtype))
        assert "its trial torch.bfloat16 matmul disagrees with F.linear" in vnni_gemm.unavailable()
        assert packed_weights._layout_for(weight, batch_invariant=False) == "onednn"


@needs_kernel
def test_batch_invariant_mode_fp16_and_shapes_it_cannot_take_keep_onednn(monkeypatch):
    monkeypatch.setenv(envs.CPU_BF16_GEMM, "auto")
    monkeypatch.setenv(envs.CPU_FP32_GEMM, "auto")
    bf16 = torch.randn(32, 64).bfloat16()
    assert packed_weights._layout_for(bf16, batch_invariant=False) == "vnni"
    assert packed_weights._layout_for(bf16, batch_invariant=True) == "onednn"
    assert packed_weights._layout_for(bf16.float(), batch_invariant=False) == "vnni"
    assert packed_weights._layout_for(bf16.float(), batch_invariant=True) == "onednn"
    assert packed_weights._layout_for(bf16.half(), batch_invariant=False) == "onednn"
    assert packed_weights._layout_for(torch.randn(40, 64).bfloat16(), batch_invariant=False) == "onednn"
    assert packed_weights._layout_for(torch.randn(32, 63).bfloat16(), batch_invariant=False) == "onednn"
    monkeypatch.setenv(envs.CPU_FP32_GEMM, "onednn")  # each dtype's own variable
    assert packed_weights._layout_for(bf16.float(), batch_invariant=False) == "onednn"
    assert packed_weights._layout_for(bf16, batch_invariant=False) == "vnni"


def test_the_fp32_choice_and_its_errors(monkeypatch, fresh_availability):
    monkeypatch.setenv(envs.CPU_FP32_GEMM, "avx512")
    with pytest.raises(ConfigError, match="SPMD_ENGINE_CPU_FP32_GEMM='avx512': expected 'auto', 'onednn' or 'vnni'"):
        vnni_gemm.wanted(torch.float32)
    from spmd_engine import platform
    monkeypatch.setattr(platform, "cpu_flags", lambda: frozenset({"avx2"}))
    monkeypatch.setenv(envs.CPU_FP32_GEMM, "auto")
    assert not vnni_gemm.wanted(torch.float32)
    monkeypatch.setenv(envs.CPU_FP32_GEMM, "vnni")
    with pytest.raises(ConfigError, match="SPMD_ENGINE_CPU_FP32_GEMM=vnni, but the kernel is unavailable: this CPU lacks"):
        vnni_gemm.wanted(torch.float32)


def test_the_kernel_is_used_wherever_the_cpu_has_the_instructions_and_g_plus_plus_is_there():
    """Else a kernel broken so that its trial fails would only skip the tests above."""
    from spmd_engine.platform import cpu_flags
    flags = cpu_flags()
    if not all(flags.intersection(names) for names in vnni_gemm.NEEDED_FLAGS) or shutil.which("g++") is None:
        pytest.skip("no AVX-512 or no g++ here: the kernel is not expected")
    assert vnni_gemm.unavailable(torch.float32) is None
    if all(flags.intersection(names) for names in vnni_gemm.BF16_FLAGS):
        assert REASON is None


_NO_BF16 = """
import json, sys, torch
from spmd_engine import platform
from spmd_engine.kernels import native, vnni_gemm, packed_weights
flags = platform.cpu_flags() - {"avx512_bf16", "amx_bf16", "amx_tile"}
platform.cpu_flags = lambda: flags
w, x = torch.randn(48, 40, dtype=torch.float64), torch.randn(7, 40, dtype=torch.float64)
out = {"bf16": vnni_gemm.unavailable(torch.bfloat16), "fp32": vnni_gemm.unavailable(torch.float32),
       "options": native._not_on_this_cpu()}
if out["fp32"] is not None:  # the build failed: nothing more to ask
    print(json.dumps(out))
    sys.exit(0)
out.update({"has_bf16": bool(torch.ops.spmd_vnni_gemm.has_bf16()),
       "wanted": [vnni_gemm.wanted(torch.float32), vnni_gemm.wanted(torch.bfloat16)],
       "layouts": [packed_weights._layout_for(w.float(), batch_invariant=False),
                   packed_weights._layout_for(w.bfloat16(), batch_invariant=False)],
       "max_error": (vnni_gemm.linear(x.float(), vnni_gemm.pack(w.float())).double() - x @ w.T).abs().max().item()})
try:
    vnni_gemm.linear(x.bfloat16(), torch.zeros(3, 20, 16, 2, dtype=torch.bfloat16))
except RuntimeError as exc:
    out["bf16_call"] = str(exc).splitlines()[0]
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_cpu_with_avx512_but_not_bf16_gets_the_fp32_path(tmp_path):
    """Skylake to Ice Lake: AVX-512 F, BW and VL without AVX512-BF16. The library is built as
    for such a CPU (the engine's flags without avx512_bf16 and AMX: -mno-avx512bf16 and the AMX
    options, in a process of its own, since one process holds one build of the library): fp32
    weights take the kernel and match an fp64 matmul, bf16 ones stay with oneDNN, and a bf16
    call into that build is a clear error."""
    from spmd_engine.platform import cpu_flags
    if not all(cpu_flags().intersection(names) for names in vnni_gemm.NEEDED_FLAGS) or shutil.which("g++") is None:
        pytest.skip("no AVX-512 or no g++ here")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", _NO_BF16], env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # Those -march=native would have turned on here (on a CPU without BF16, none: has_bf16 below
    # is then false anyway, and on one with it, only because the option was passed).
    assert set(got["options"]) <= {"-mno-avx512bf16", "-mno-amx-tile", "-mno-amx-bf16"}, got
    assert got["bf16"] == "this CPU lacks avx512_bf16" and got["fp32"] is None, got
    assert got["has_bf16"] is False and got["wanted"] == [True, False], got
    assert got["layouts"] == ["vnni", "onednn"], got
    assert got["max_error"] < 1e-4, got
    assert "bf16 weights need a build for a CPU with AVX512-BF16" in got["bf16_call"], got


@pytest.fixture(params=[1, 2], ids=["1_thread", "2_threads"])
def threads(request):
    """The suite runs one OpenMP thread; with two, each thread's columns are a range of their
    own, and the ranges' results must join in column order."""
    was = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(was)


@needs_kernel
@pytest.mark.parametrize("n,k", [(16, 2), (48, 64), (512, 96), (1008, 512)])
def test_the_fused_argmax_is_torch_argmax_of_the_kernels_logits(n, k, dtype_and_path, threads):
    """linear_argmax scans each thread's columns as they are written (16 lanes, the scalar order
    on a NaN): ties go to the first column (twins in the other thread's half included), a NaN
    beats everything and the first NaN wins, rows of -inf give column 0, and padding columns past
    `valid` never compete."""
    dtype = dtype_and_path
    gen = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=gen).to(dtype)
    w[n // 2:] = w[: n - n // 2]  # every column has a twin: ties everywhere
    packed = vnni_gemm.pack(w)
    for m in (0, 1, 7, 8, 17, 33):
        x = torch.randn(m, k, generator=gen).to(dtype)
        for valid in (n, max(1, n - 13), 1):
            want = vnni_gemm.linear(x, packed)[:, :valid].float().argmax(-1)
            assert torch.equal(vnni_gemm.linear_argmax(x, packed, valid), want), (m, valid)
    special = w.clone()
    special[n - 1] = float("nan")  # NaN in the last column for a row with x != 0
    special[n // 3] = float("inf")
    x = torch.randn(6, k, generator=gen).to(dtype)
    x[2] = 0  # 0 * inf = NaN: the inf column turns NaN and comes first
    packed = vnni_gemm.pack(special)
    want = vnni_gemm.linear(x, packed).float().argmax(-1)
    assert torch.equal(vnni_gemm.linear_argmax(x, packed), want)
    negative = vnni_gemm.pack(torch.cat([-w[: n - 3].abs() - 1, torch.zeros(3, k).to(dtype)]))
    x = torch.rand(4, k, generator=gen).to(dtype) + 0.5  # real logits all below 0, padding exactly 0
    want = vnni_gemm.linear(x, negative)[:, : n - 3].float().argmax(-1)
    assert torch.equal(vnni_gemm.linear_argmax(x, negative, n - 3), want)


@needs_kernel
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("arch,layout", [(LLAMA, "vnni"), (QWEN_TIED, "vnni"), (LLAMA, "onednn")],
                         ids=["llama", "qwen_biased_tied", "llama_onednn"])
def test_a_models_greedy_tokens_are_the_argmax_of_its_logits(tmp_path, arch, layout, dtype, monkeypatch):
    """The LM head's fused argmax (the kernel's layout, a padded vocabulary, a tied head) and its
    fallback (oneDNN's layout) give what argmax over compute_logits gives."""
    from spmd_engine.sample.sampler import greedy_tokens
    path = make_random_checkpoint(tmp_path / "m", **arch, dtype=dtype)
    monkeypatch.setenv(envs.CPU_BF16_GEMM, layout)
    monkeypatch.setenv(envs.CPU_FP32_GEMM, layout)
    model = load_model(path, SoloGroup(), SoloGroup(), dtype=getattr(torch, dtype))
    packed_weights.pack_linear_weights(model, batch_hint=8)
    head = model.lm_head
    assert head.padded_vocab_size > head.vocab_size  # the padding rows must not compete
    assert packed_weights.layout(head.weight) == layout
    gen = torch.Generator().manual_seed(3)
    for rows in (1, 8, 13):
        hidden = torch.randn(rows, arch["hidden_size"], generator=gen).to(getattr(torch, dtype)) * 4
        assert torch.equal(model.greedy_tokens(hidden), greedy_tokens(model.compute_logits(hidden)))
