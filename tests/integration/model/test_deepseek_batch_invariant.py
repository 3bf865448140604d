"""DeepSeek-V3 (multi-head latent attention, grouped router) in batch-invariant mode.

The tiny V3 checkpoint of tests/helpers/deepseek_checkpoint.py through the engine with
batch_invariant=True: greedy tokens and logprobs equal transformers' (fp32 tolerance), a
prompt's tokens and logprobs are the same bits alone and among a batch of others (the
per-head latent products, the attention whose values are the keys' first channels, the
float32 router). Slow: the same for V2, the needle test in bf16 and compiled, and TP 2 and
TP 4 (all the tiny config's four heads allow) giving the bits of TP 1.
"""

from __future__ import annotations

import random
import sys

import pytest
import torch
from deepseek_checkpoint import CONFIGS, make_deepseek_checkpoint
from launch import REPO
from test_deepseek_engine import CHUNKED, cached_hf_model
from test_hf_reference import engine_outputs, prompts_for
from test_moe import check_against_hf

from spmd_engine import LLM, SamplingParams
from spmd_engine.model.models.deepseek import MLAttention

sys.path.insert(0, str(REPO / "tests" / "helpers" / "dist_scripts"))
from batch_invariant_layouts import record, workload  # noqa: E402

VOCAB = CONFIGS["v3"]["vocab_size"]


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    return make_deepseek_checkpoint(tmp_path_factory.mktemp("deepseek_bi") / "v3", "v3", seed=40)


@pytest.fixture(scope="module")
def v2(tmp_path_factory):
    return make_deepseek_checkpoint(tmp_path_factory.mktemp("deepseek_bi") / "v2", "v2", seed=41)


def needle_mismatches(llm: LLM, trials: int, seed: int = 0) -> list[str]:
    """A prompt (greedy, with prompt logprobs) alone, then at a random place among 1-40 others."""
    rng = random.Random(seed)
    needle = [rng.randrange(VOCAB) for _ in range(29)]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, prompt_logprobs=5, ignore_eos=True)
    want = record(llm.generate([needle], params, use_tqdm=False)[0])
    bad = []
    for trial in range(trials):
        others = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 60))] for _ in range(rng.randrange(1, 40))]
        at = rng.randrange(len(others) + 1)
        sp = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 7), ignore_eos=True)] * len(others)
        outs = llm.generate(others[:at] + [needle] + others[at:], sp[:at] + [params] + sp[at:], use_tqdm=False)
        if record(outs[at]) != want:
            bad.append(f"trial {trial}: {len(others)} others, needle at {at}")
    return bad


def equals_transformers_and_alone_equals_batched(path) -> None:
    prompts = prompts_for(VOCAB)
    outputs = engine_outputs(path, prompts, batch_invariant=True, **CHUNKED)
    problems = check_against_hf(path, prompts, outputs, cached_hf_model(path))
    assert not problems, "\n".join(problems[:10])
    with LLM(model=str(path), batch_invariant=True) as llm:
        assert needle_mismatches(llm, trials=3) == []


@pytest.mark.timeout(240)
def test_v3_equals_transformers_and_a_prompt_alone_equals_it_batched(v3):
    equals_transformers_and_alone_equals_batched(v3)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_v2_equals_transformers_and_a_prompt_alone_equals_it_batched(v2):
    """V2: a plain q_proj, the softmax router over group-limited experts."""
    equals_transformers_and_alone_equals_batched(v2)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", [dict(dtype="bfloat16"), dict(enforce_eager=False)], ids=["bf16", "compiled"])
def test_v3_alone_equals_batched_in_bf16_and_compiled(v3, mode):
    with LLM(model=str(v3), batch_invariant=True, **mode) as llm:
        assert needle_mismatches(llm, trials=2) == []


@pytest.mark.timeout(240)
def test_negative_control_einsum_per_head_products_differ_batched(v3, monkeypatch):
    """The latent products as one batched einsum (the default mode's) in batch-invariant mode:
    the GEMM's sums follow the token count, and the needle test sees it."""
    monkeypatch.setattr(MLAttention, "per_head", lambda self, x, w: torch.einsum("...hk,hnk->...hn", x, w))
    with LLM(model=str(v3), batch_invariant=True) as llm:
        assert needle_mismatches(llm, trials=3) != []


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_tp2_and_tp4_equal_tp1_bitwise(v3):
    runs = []
    for tp in (1, 2, 4):
        with LLM(model=str(v3), batch_invariant=True, tensor_parallel_size=tp) as llm:
            runs.append(workload(llm, VOCAB))
    assert runs[0] == runs[1], "TP 2"
    assert runs[0] == runs[2], "TP 4"
