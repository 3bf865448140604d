"""Batch-invariant mode (issue 24): a request's tokens and logprobs, bit for bit, whatever else runs.

References: the same request alone (the needle test), the sequence fed back as a prompt, the
trainer's forward (model/trainer.py), uni's outputs for every other layout. `==` on floats.
Negative controls: the default mode fails the needle test, a matmul whose reduction split
depends on the row count fails it, and TP2 differs from TP1 in the default mode.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch

from spmd_engine import LLM, SamplingParams, envs
from spmd_engine.model.layers import batch_invariant as bi
from tests.helpers.engine_helpers import make_random_checkpoint, make_tiny_checkpoint
from tests.helpers.launch import run_torchrun

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers" / "dist_scripts"))
from batch_invariant_layouts import record, workload  # noqa: E402

VOCAB = 300
SCRIPT = Path(__file__).resolve().parents[2] / "helpers" / "dist_scripts" / "batch_invariant_layouts.py"
MOE = {
    "qwen3moe": dict(architecture="Qwen3MoeForCausalLM", hidden_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, intermediate_size=96, vocab_size=139, num_experts=8,
                     num_experts_per_tok=2, moe_intermediate_size=32),
    "mixtral": dict(architecture="MixtralForCausalLM", hidden_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, intermediate_size=64, vocab_size=131, num_experts=4, num_experts_per_tok=2),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("bi") / "tiny")


def needle_params():
    return [SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, prompt_logprobs=5, ignore_eos=True),
            SamplingParams(max_tokens=8, logprobs=5, prompt_logprobs=5, temperature=1.0, top_k=20, seed=11,
                           ignore_eos=True)]


def needle_mismatches(llm: LLM, trials: int, seed: int = 0) -> list[str]:
    """The needle (greedy and seeded) alone, then at a random place among 1-63 random others."""
    rng = random.Random(seed)
    needle = [rng.randrange(VOCAB) for _ in range(37)]
    params = needle_params()
    alone = [record(o) for o in llm.generate([needle] * 2, params, use_tqdm=False)]
    bad = []
    for trial in range(trials):
        others = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 100))] for _ in range(rng.randrange(1, 64))]
        at = rng.randrange(len(others) + 1)
        for p, want in zip(params, alone):
            prompts = others[:at] + [needle] + others[at:]
            sp = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 9), ignore_eos=True, logprobs=2)] * len(others)
            outs = llm.generate(prompts, sp[:at] + [p] + sp[at:], use_tqdm=False)
            if record(outs[at]) != want:
                bad.append(f"trial {trial}: {len(others)} others, needle at {at}, T={p.temperature}")
    return bad


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_needle_invariant_across_batches_budgets_cache_and_preemption(tiny, dtype):
    """Default budget, chunks of 16 and 64, block size 8, prefix hits (warm: the same needle
    again) and a KV cache small enough to preempt: every run equals the needle alone. bf16
    has its own attention (torch's SDPA where it is invariant) and packed row-parallel slices."""
    ref = LLM(model=str(tiny), batch_invariant=True, dtype=dtype)
    assert needle_mismatches(ref, trials=2) == []
    alone = needle_mismatches  # the same seed: the same needle and batches in every engine
    ref.shutdown()
    itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    small = dict(block_size=8, kv_cache_memory_bytes=itemsize * 64 * 2 * 8 * 60, max_num_batched_tokens=64)
    for kwargs in (dict(max_num_batched_tokens=16, enable_prefix_caching=False), small):
        with LLM(model=str(tiny), batch_invariant=True, dtype=dtype, **kwargs) as llm:
            assert alone(llm, trials=2) == [], kwargs
            stats = llm.get_stats()
            if kwargs is small:
                assert sum(s["preemptions"] for s in stats) > 0
                assert sum(s["prefix_hits_tokens"] for s in stats) > 0


def test_negative_controls_fail_the_needle_test(tiny, monkeypatch):
    with LLM(model=str(tiny)) as llm:  # the default mode
        assert needle_mismatches(llm, trials=3) != []

    def split_by_rows(x, weight, bias=None):  # a reduction split chosen by the row count
        rows = x.reshape(-1, x.shape[-1]).shape[0]
        halves = 2 if rows > 8 else 1
        y = sum(torch.nn.functional.linear(xc, wc) for xc, wc in zip(x.chunk(halves, -1), weight.chunk(halves, -1)))
        return y if bias is None else y + bias

    monkeypatch.setattr(bi, "linear", split_by_rows)
    monkeypatch.setenv(envs.CPU_PACKED_WEIGHTS, "0")  # the stand-in slices dense weights
    with LLM(model=str(tiny), batch_invariant=True) as llm:
        assert needle_mismatches(llm, trials=3) != []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_equals_prefill_and_the_trainer_with_a_backward(tiny, dtype):
    """bf16: the engine packs its column-parallel and LM-head weights for oneDNN where the CPU
    has bf16 kernels; the trainer's stay dense, the bits the same."""
    from spmd_engine.model.trainer import token_logprobs, trainer_model
    rng = random.Random(5)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(3, 60))] for _ in range(5)]
    with LLM(model=str(tiny), batch_invariant=True, dtype=dtype) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=10, logprobs=0, temperature=1.0, seed=3,
                                                    ignore_eos=True), use_tqdm=False)
        seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
        decode = [[d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]
        fed = llm.generate(seqs, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, ignore_eos=True), use_tqdm=False)
    prefill = [[d[t].logprob for t, d in zip(s[1:], f.prompt_logprobs[1:])] for s, f in zip(seqs, fed)]
    model = trainer_model(tiny, dtype=dtype)
    trained = token_logprobs(model, seqs)
    for p, dec, pre, tr in zip(prompts, decode, prefill, trained):
        assert pre[len(p) - 1:] == dec
        assert tr.tolist() == pre
    sum(t.sum() for t in trained).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


def test_thread_count_does_not_change_bits(tmp_path):
    """uni at 1, 2 and 3 threads (mp gives each worker a share of the cores), on a model
    wide enough (hidden 1024) that MKL would split a GEMM's K between threads when its
    batch has fewer products than threads."""
    wide = make_random_checkpoint(tmp_path / "wide", hidden_size=1024, num_layers=1, num_heads=8,
                                  num_kv_heads=2, intermediate_size=256, vocab_size=VOCAB, seed=4)
    before, results = torch.get_num_threads(), []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            with LLM(model=str(wide), batch_invariant=True) as llm:
                results.append(workload(llm, VOCAB))
    finally:
        torch.set_num_threads(before)
    assert results[1] == results[0] and results[2] == results[0]


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.xdist_group("world8")
def test_layouts_tp_1_2_4_8_pp_dp_ep_and_moe(tiny, tmp_path):
    """One world-8 torchrun launch runs every layout in turn; uni and mp TP2xPP2 in this process."""
    moe = {name: make_random_checkpoint(tmp_path / name, seed=3, **cfg) for name, cfg in MOE.items()}
    dense = [dict(tensor_parallel_size=tp) for tp in (1, 2, 4, 8)] + [
        dict(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2),
        dict(tensor_parallel_size=2, pipeline_parallel_size=4, pp_partition="1,1,1,1")]
    sparse = [dict(tensor_parallel_size=2), dict(tensor_parallel_size=2, enable_expert_parallel=True),
              dict(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True)]
    dense += [dict(tensor_parallel_size=tp, dtype="bfloat16") for tp in (1, 2, 8)]
    plan = [{"model": str(tiny), "layout": dict(d, batch_invariant=True)} for d in dense]
    plan += [{"model": str(path), "layout": dict(s, batch_invariant=True)} for path in moe.values() for s in sparse]
    plan += [{"model": str(tiny), "layout": dict(tensor_parallel_size=tp)} for tp in (1, 2)]  # default mode
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    launch = run_torchrun(8, [SCRIPT, tmp_path / "plan.json", tmp_path / "out.json"], timeout=400,
                          env_extra={"OMP_NUM_THREADS": "1"})
    assert launch.returncode == 0 and not launch.timed_out, launch.describe()
    results = json.loads((tmp_path / "out.json").read_text())

    def uni(model, **kwargs):
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        with LLM(model=str(model), batch_invariant=True, **kwargs) as llm:
            return json.loads(json.dumps(workload(llm, vocab)))  # JSON's floats, as the launch's

    want = {dtype: uni(tiny, dtype=dtype) for dtype in ("float32", "bfloat16")}
    for entry, got in zip(plan[:len(dense)], results):
        assert got == want[entry["layout"].get("dtype", "float32")], entry["layout"]
    assert uni(tiny, tensor_parallel_size=2, pipeline_parallel_size=2) == want["float32"]  # mp, 1 thread a worker
    for i, path in enumerate(moe.values()):
        want_moe = uni(path)
        for j, s in enumerate(sparse):
            assert results[len(dense) + i * len(sparse) + j] == want_moe, (path.name, s)
    default_tp1, default_tp2 = results[-2:]
    assert default_tp1 != default_tp2  # negative control: the default mode's all-reduce order
