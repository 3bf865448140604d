"""Pre-packed CPU weights (spmd_engine/kernels/packed_weights.py).

Packing changes the matmul kernel, never the model: bf16 logits stay bitwise
identical to `F.linear`'s, fp32 ones equal up to summation order, the dense
copy is freed, and the worker packs only where it helps (CPU, fp32/bf16) and
not when switched off.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fake_groups import SoloGroup
from model_helpers import LLAMA, QWEN_TIED, make_random_checkpoint, run_schedule

from spmd_engine import LLM, SamplingParams
from spmd_engine.kernels import vnni_gemm
from spmd_engine.kernels.packed_weights import (
    ENV_FLAG,
    dense_weight,
    is_packed,
    layout,
    pack_linear_weights,
    packing_applies,
)
from spmd_engine.model import load_model

BF16_KERNELS = packing_applies(torch.bfloat16, torch.device("cpu"))
needs_bf16 = pytest.mark.skipif(not BF16_KERNELS, reason="this CPU's oneDNN has no bf16 kernels")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed")
    # Llama: plain projections, llama3 rope; Qwen2: biased QKV and a tied LM head.
    return {"llama": make_random_checkpoint(root / "llama", **LLAMA),
            "qwen_tied": make_random_checkpoint(root / "qwen", **QWEN_TIED)}


def logits_of(path, dtype: torch.dtype, packed: bool) -> list[np.ndarray]:
    solo = SoloGroup()
    model = load_model(path, solo, solo, dtype=dtype)
    if packed:
        assert pack_linear_weights(model, batch_hint=3) > 0
    with torch.no_grad():
        return [x.astype(np.float64) for x in run_schedule(model)]


@needs_bf16
@pytest.mark.parametrize("name", ["llama", "qwen_tied"])
def test_bf16_packed_logits_are_bitwise_identical(checkpoints, name):
    plain = logits_of(checkpoints[name], torch.bfloat16, packed=False)
    packed = logits_of(checkpoints[name], torch.bfloat16, packed=True)
    for step, (a, b) in enumerate(zip(plain, packed)):
        assert np.array_equal(a, b), f"step {step}: max diff {np.abs(a - b).max()}"


@pytest.mark.parametrize("name", ["llama", "qwen_tied"])
def test_fp32_packed_logits_differ_only_by_summation_order(checkpoints, name):
    plain = logits_of(checkpoints[name], torch.float32, packed=False)
    packed = logits_of(checkpoints[name], torch.float32, packed=True)
    for a, b in zip(plain, packed):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)])
def test_packing_replaces_each_dense_weight_and_keeps_its_values(checkpoints, dtype):
    solo = SoloGroup()
    model = load_model(checkpoints["qwen_tied"], solo, solo, dtype=dtype)
    packable = {name: m.weight.detach().clone() for name, m in model.named_modules()
                if getattr(m, "packable_weight", False)}
    embedding = model.model.embed_tokens.weight
    # 4 layers x (qkv, o, gate_up, down) + the LM head
    assert pack_linear_weights(model, batch_hint=8) == len(packable) == 4 * 4 + 1
    for name, dense in packable.items():
        weight = model.get_submodule(name).weight
        # bf16 and fp32 go to the hand-written kernel where this CPU has it and the shape fits it
        vnni = vnni_gemm.unavailable() is None and vnni_gemm.fits(*dense.shape, dtype)
        assert layout(weight) == ("vnni" if vnni else "onednn"), name
        per_line = 2 if dtype == torch.bfloat16 else 1
        assert weight.dtype == dtype and weight.shape == (dense.shape if not vnni else
                                                          (dense.shape[0] // 16, dense.shape[1] // per_line, 16,
                                                           per_line)), name
        assert torch.equal(dense_weight(weight), dense), name
    # The tied embedding keeps its dense table for lookups; the head got a packed copy.
    assert model.model.embed_tokens.weight is embedding and not is_packed(embedding)
    assert torch.equal(dense_weight(model.lm_head.weight), embedding)
    assert pack_linear_weights(model, batch_hint=8) == 0  # packing twice is a no-op


def test_packing_applies_on_cpu_fp32_only_unless_switched_off(monkeypatch):
    cpu = torch.device("cpu")
    assert packing_applies(torch.float32, cpu)
    assert not packing_applies(torch.float16, cpu)
    assert not packing_applies(torch.float32, torch.device("cuda", 0))
    monkeypatch.setenv(ENV_FLAG, "0")
    assert not packing_applies(torch.float32, cpu)
    assert not packing_applies(torch.bfloat16, cpu)


def _generate(dtype: str) -> tuple[list[list[int]], list[bool]]:
    llm = LLM(dtype=dtype, distributed_executor_backend="uni", max_num_seqs=4)
    try:
        outs = llm.generate(["Beautiful is", "Errors should", "Now is", "If the"],
                            SamplingParams(max_tokens=24, temperature=0.0))
        packed = llm.collective_rpc(lambda worker: is_packed(worker.model.lm_head.weight))
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], packed


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=needs_bf16)])
def test_worker_packs_by_default_and_generates_the_same_text(dtype, monkeypatch):
    tokens, packed = _generate(dtype)
    assert packed == [True]
    monkeypatch.setenv(ENV_FLAG, "0")
    plain_tokens, plain = _generate(dtype)
    assert plain == [False]
    assert tokens == plain_tokens


def test_a_failing_or_wrong_packed_matmul_keeps_plain_weights(monkeypatch):
    """The oneDNN ops are private: where they raise or disagree with F.linear, no packing."""
    from spmd_engine.kernels import packed_weights

    def broken(weight, batch_size=None):
        raise RuntimeError("no oneDNN kernel for this CPU")

    for fake in (broken, lambda weight, batch_size=None: (weight * 2).to_mkldnn()):
        packed_weights._trial_matmul_agrees.cache_clear()
        monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", fake)
        assert not packing_applies(torch.float32, torch.device("cpu"))
        monkeypatch.undo()
    packed_weights._trial_matmul_agrees.cache_clear()
    assert packing_applies(torch.float32, torch.device("cpu"))


@needs_bf16
def test_batch_invariant_row_parallel_slices_follow_every_load_and_discard():
    """bf16 batch-invariant mode keeps packed copies of the row-parallel K slices beside the
    dense weight: an in-place load (a trainer's update), a discard and a new allocation must
    each be seen, or the engine would serve the old weights."""
    from spmd_engine.model.layers.linear import RowParallelLinear
    layer = RowParallelLinear(256, 64, SoloGroup(), dtype=torch.bfloat16)
    layer.batch_invariant = True
    gen = torch.Generator().manual_seed(0)
    first, second = (torch.randn(64, 256, generator=gen).bfloat16() for _ in range(2))
    layer.weight_loader(layer.weight, first)
    x = torch.randn(5, 256, generator=gen).bfloat16()
    dense = layer(x)  # before packing: the dense weight's slices
    layer.pack_slices(8)
    assert torch.equal(layer(x), dense)  # the packed slices: the same bits
    layer.weight_loader(layer.weight, second)  # in place: the same storage
    want = RowParallelLinear(256, 64, SoloGroup(), dtype=torch.bfloat16)
    want.batch_invariant = True
    want.weight_loader(want.weight, second)
    assert torch.equal(layer(x), want(x))
    layer.drop_packed()
    layer.weight.data = torch.empty(64, 256, dtype=torch.bfloat16)  # as allocate_discarded_weights
    layer.weight.data.copy_(first)
    assert torch.equal(layer(x), dense)
