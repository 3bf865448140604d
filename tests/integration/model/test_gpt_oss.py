"""gpt-oss (GptOssForCausalLM) against transformers' own model on a tiny random checkpoint
with every feature on (tests/helpers/gpt_oss_checkpoint.py). Quick: the model's forward logits
(no cache) and each rank's slices of the fused expert tensors. Slow, the engine: greedy tokens equal and
logprobs within fp32 tolerance (teacher-forced, test_hf_reference.py's check), prompts longer
than the sliding window. Layouts: uni, TP 2 x PP 2, TP 2 with expert parallelism, DP 2 with
EP (token dispatch), torchrun TP 2 x DP 2; batch-invariant mode;
routing replay, chunked prefill, prefix cache hits and preemption (greedy tokens checked).
Negative controls: our engine on the same weights with the SwiGLU limit raised or the window
widened (config only) must disagree with transformers on the original.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from dist_scripts.routed_experts import rounds
from gpt_oss_checkpoint import WINDOW, make_gpt_oss_checkpoint
from launch import REPO, run_torchrun
from test_hf_reference import (
    TIE_MARGIN,
    copy_with_config,
    disagreements,
    engine_outputs,
    hf_logprobs,
    hf_model,
    prompts_for,
)

from spmd_engine import LLM
from spmd_engine.config import ConfigError
from spmd_engine.model.spec import ModelSpec

VOCAB = 97


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_gpt_oss_checkpoint(tmp_path_factory.mktemp("gpt_oss") / "ckpt", seed=3)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return hf_model(checkpoint)


def problems_against(hf, prompts, outputs) -> list[str]:
    problems = []
    for prompt, (tokens, logprobs) in zip(prompts, outputs, strict=True):
        problems += disagreements(prompt, tokens, logprobs, hf_logprobs(hf, prompt, tokens))
    return problems


def prompts() -> list[list[int]]:
    out = prompts_for(VOCAB)
    assert max(len(p) for p in out) > 2 * WINDOW  # the window hides early tokens
    return out


@pytest.mark.timeout(60)
@torch.inference_mode()
def test_model_forward_logits_match_transformers(checkpoint, reference):
    """The model alone (no cache, one 20-token row past the window): fp32 logits equal."""
    from spmd_engine.model.loader import load_model
    from spmd_engine.model.solo import SoloGroup
    model = load_model(checkpoint, SoloGroup(), SoloGroup(), dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(20).expand(2, 20)
    ours = model.compute_logits(model(ids, positions, None)["hidden_states"].reshape(40, -1)).view(2, 20, -1)
    torch.testing.assert_close(ours, reference(ids).logits.float(), atol=2e-5, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_uni_matches_transformers(checkpoint, reference):
    problems = problems_against(reference, prompts(), engine_outputs(checkpoint, prompts()))
    assert not problems, "\n".join(problems[:10])


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("change", [dict(swiglu_limit=7.0), dict(sliding_window=64)],
                         ids=["swiglu_limit", "window"])
def test_negative_control_config_changes_are_caught(checkpoint, reference, tmp_path, change):
    """Our engine on the same weights with one feature changed must disagree with transformers."""
    changed = copy_with_config(checkpoint, tmp_path / "changed", **change)
    assert problems_against(reference, prompts(), engine_outputs(changed, prompts()))


@pytest.mark.timeout(60)
def test_quantized_checkpoint_refused(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    with pytest.raises(ConfigError, match="quantization_config") as info:
        ModelSpec.from_hf_config(config)
    assert "\n" not in str(info.value)


LAYOUTS = {
    "tp2-pp2": dict(tensor_parallel_size=2, pipeline_parallel_size=2),
    "tp2-ep": dict(tensor_parallel_size=2, enable_expert_parallel=True),
    "dp2-ep": dict(data_parallel_size=2, enable_expert_parallel=True),  # token dispatch across replicas
    "dp2": dict(data_parallel_size=2),  # each expert's width over DP x TP
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mp_layouts_match_transformers(checkpoint, reference, layout):
    outputs = engine_outputs(checkpoint, prompts(), distributed_executor_backend="mp", **LAYOUTS[layout])
    problems = problems_against(reference, prompts(), outputs)
    assert not problems, "\n".join(problems[:10])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_batch_invariant_matches_transformers(checkpoint, reference):
    """Batch-invariant tiles with sinks and windows, the experts' invariant sums with their biases.
    (A compiled forward runs MoE models' layers eager: the sinks' compiled op and traced decode
    step are checked in tests/unit/model/test_sink_attention.py.)"""
    outputs = engine_outputs(checkpoint, prompts(), batch_invariant=True)
    problems = problems_against(reference, prompts(), outputs)
    assert not problems, "\n".join(problems[:10])


# ---- routing replay, prefix cache, chunked prefill, preemption ----------------------------------------

@torch.inference_mode()
def hf_routing(model, ids: list[int]) -> np.ndarray:
    """transformers' expert picks for `ids`, [len(ids), layers, k]: each GptOssTopKRouter's
    indices (its forward returns logits, scores, indices)."""
    picks = []
    routers = [layer.mlp.router for layer in model.model.layers]
    hooks = [r.register_forward_hook(lambda m, a, out: picks.append(out[2])) for r in routers]
    try:
        model(torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack([p.reshape(len(ids), -1) for p in picks], dim=1).numpy()


def greedy_problems(hf, prompt, tokens) -> list[str]:
    """Each generated token must be transformers' argmax (unless its top two nearly tie)."""
    ref = hf_logprobs(hf, prompt, tokens)
    problems = []
    for step, token in enumerate(tokens):
        top2 = ref[step].topk(2)
        if token != int(top2.indices[0]) and float(top2.values[0] - top2.values[1]) > TIE_MARGIN:
            problems.append(f"prompt of {len(prompt)} step {step}: token {token}, reference {int(top2.indices[0])}")
    return problems


def replay_problems(hf, result: dict) -> list[str]:
    problems = []
    for i, r in enumerate(result["records"]):
        problems += greedy_problems(hf, r["prompt"], r["tokens"])
        ours, ref = np.asarray(r["routed"]), hf_routing(hf, r["prompt"] + r["tokens"][:-1])
        if ours.shape != ref.shape or not np.array_equal(ours, ref):
            problems.append(f"output {i}: routed experts {ours.shape} differ from transformers' {ref.shape}")
    return problems


BLOCK = 8
PER_TOKEN = 2 * 2 * 16 * 4 * 4  # K and V, 2 KV heads of 16, 4 layers, fp32


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tight", [False, True], ids=["prefix-hits", "chunked-preempted"])
def test_routing_replay_prefix_cache_chunks_and_preemption(checkpoint, reference, tight):
    """Two rounds (the second's prompts are the first's sequences: prefix cache hits); `tight`:
    8-token chunks and a KV cache of 10 blocks for 5 sequences of up to 41 tokens (preemption)."""
    extra = dict(max_num_batched_tokens=BLOCK, kv_cache_memory_bytes=10 * BLOCK * PER_TOKEN,
                 max_model_len=48) if tight else {}
    with LLM(model=str(checkpoint), enable_return_routed_experts=True, block_size=BLOCK, **extra) as llm:
        result = rounds(llm, prompts())
    assert result["prefix_hits_tokens"] > 0
    if tight:
        assert result["preemptions"] > 0
    problems = replay_problems(reference, result)
    assert not problems, "\n".join(problems[:10])
    r = result["records"][3]  # negative control: the same rows one position late disagree
    assert replay_problems(reference, {"records": [dict(r, routed=[r["routed"][0]] + r["routed"][:-1])]})


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("ep", [False, True], ids=["tp2-x-dp2", "tp2-ep-x-dp2"])
def test_torchrun_tp2_dp2_matches_transformers(checkpoint, reference, tmp_path, ep):
    """A world of 4 under torchrun: TP 2 in two external-DP replicas, every rank's outputs."""
    (tmp_path / "prompts.json").write_text(json.dumps(prompts()))
    layout = dict(tensor_parallel_size=2, enable_expert_parallel=ep, block_size=BLOCK,
                  distributed_executor_backend="external_launcher")
    run = run_torchrun(4, [REPO / "tests" / "helpers" / "dist_scripts" / "routed_experts.py", checkpoint,
                           tmp_path / "prompts.json", tmp_path / "out.json", json.dumps(layout)], timeout=280)
    assert run.returncode == 0 and not run.timed_out, run.describe()
    assert not run.leftover_pids and not run.stale_segments(), run.describe()
    results = [json.loads((tmp_path / f"out.json.rank{r}").read_text()) for r in range(4)]
    assert all(r["records"] == results[0]["records"] for r in results)
    problems = replay_problems(reference, results[0])
    assert not problems, "\n".join(problems[:10])


# ---- per-rank slices of the all-experts tensors -----------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
def test_each_rank_reads_and_holds_its_slice_of_the_fused_experts(checkpoint, ep):
    """Rank 1 of 2 reads experts 2-3 whole (EP) or half of every expert's width (TP) of HF's
    [E, H, 2I] interleaved gate_up tensor, holds them as gate rows then up rows, and a trainer's
    full tensors (update_weights) give the same parameters."""
    from safetensors.torch import load_file
    from test_moe import FakeGroup, bytes_read_per_tensor

    from spmd_engine.model.loader import read_hf_config
    from spmd_engine.model.models.llama import CausalLM
    from spmd_engine.model.solo import SoloGroup
    log = bytes_read_per_tensor(checkpoint, 2, 1, ep=ep)
    full = 4 * 32 * 48 * 4  # 4 experts x hidden 32 x 2 * 24, float32
    assert log["model.layers.0.mlp.experts.gate_up_proj"] == full // 2
    state = load_file(str(checkpoint / "model.safetensors"))
    loaded, updated = (CausalLM(read_hf_config(checkpoint), FakeGroup(2, 1), SoloGroup(), moe_group=FakeGroup(2, 1),
                                expert_parallel=ep) for _ in range(2))
    loaded.load_weights(lambda name: state[name])
    updated.update_weights(state)
    experts = loaded.model.layers["2"].mlp.experts
    hf = state["model.layers.2.mlp.experts.gate_up_proj"]  # [E, H, 2I]
    rows, cols = (slice(2, 4), slice(0, 24)) if ep else (slice(0, 4), slice(12, 24))
    gate, up = hf[rows, :, 0::2][..., cols], hf[rows, :, 1::2][..., cols]
    assert torch.equal(experts.w13_weight, torch.cat([gate, up], dim=-1).transpose(1, 2))
    down_bias = state["model.layers.2.mlp.experts.down_proj_bias"][rows]
    assert torch.equal(experts.w2_bias, down_bias)
    assert (experts._down_bias() is None) != ep  # without EP rank 1 leaves the down bias to rank 0
    for (name, a), (_, b) in zip(loaded.named_parameters(), updated.named_parameters()):
        assert torch.equal(a, b), name
