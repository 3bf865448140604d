"""Routing replay (`LLM(enable_return_routed_experts=True)`) against transformers' routers.

Every output's `routed_experts` must equal, row for row, the experts transformers' Qwen3-MoE
and Mixtral routers pick (forward hooks on their gates) teacher-forced on the whole sequence
the engine computed: the prompt and the generated tokens but the last. Two rounds of
rollouts (tests/helpers/dist_scripts/routed_experts.py): the second resubmits each first
sequence as a prompt, so its cached prefix (prompt and decode blocks) was computed by another
request and its rows come from the routing kept with the KV cache. Layouts: uni (also with a
KV cache small enough to preempt), mp TP 2 x PP 2 + EP (the earlier stage's layers forwarded
with the hidden states), mp DP 2 + EP (engine cores in their own processes) and torchrun TP 2
+ EP in a world of 4 (two external-DP replicas, every rank's outputs).
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch
from dist_scripts.routed_experts import rounds
from launch import REPO, run_ranks_with_env, run_torchrun
from make_random_checkpoint import make_random_checkpoint
from test_hf_reference import hf_model, prompts_for
from test_moe import CONFIGS

from spmd_engine import LLM, SamplingParams
from spmd_engine.config import ConfigError

MODELS = {"qwen3moe": "qwen3moe-normtopk-step2-headdim32", "mixtral": "mixtral-4x-top2"}
BLOCK = 8  # small blocks: more of each sequence comes from the prefix cache in the second round


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("routed")
    return {short: make_random_checkpoint(root / short, seed=30 + i, **CONFIGS[name])
            for i, (short, name) in enumerate(MODELS.items())}


@torch.inference_mode()
def hf_routing(model, ids: list[int]) -> np.ndarray:
    """transformers' picks for `ids` in one forward: [len(ids), sparse layers, top_k], each
    router's top-k order (its gate returns (logits, weights, ids); an older Linear gate, its
    logits: top-k of them, as HF's softmax then top-k)."""
    k = model.config.num_experts_per_tok
    picks = []

    def keep(module, args, output):
        picks.append(output[2] if isinstance(output, tuple) else torch.topk(output, k, dim=-1).indices)
    blocks = [m for layer in model.model.layers for m in layer.modules() if type(m).__name__.endswith("SparseMoeBlock")]
    hooks = [block.gate.register_forward_hook(keep) for block in blocks]
    try:
        model(torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack([p.reshape(len(ids), k) for p in picks], dim=1).numpy()


@functools.lru_cache(maxsize=None)
def cached_hf_model(path):
    return hf_model(path)


def check_against_hf(path, result: dict) -> list[str]:
    hf = cached_hf_model(path)
    problems = []
    for i, r in enumerate(result["records"]):
        ours, seq = np.asarray(r["routed"]), r["prompt"] + r["tokens"][:-1]
        ref = hf_routing(hf, seq)
        if r["dtype"] != "int16" or ours.shape != ref.shape:
            problems.append(f"output {i}: {r['dtype']} {ours.shape}, expected int16 {ref.shape}")
        elif not np.array_equal(ours, ref):
            rows = sorted({int(p) for p in np.argwhere(ours != ref)[:, 0]})
            problems.append(f"output {i} (prompt {len(r['prompt'])}, {len(r['tokens'])} generated): "
                            f"positions {rows} differ from transformers'")
    return problems


def two_sparse_layers(result: dict) -> None:
    # Both models have two sparse layers (Qwen3-MoE: decoder_sparse_step 2 of 4 layers).
    assert {np.asarray(r["routed"]).shape[1] for r in result["records"]} == {2}


# ---- uni: in this process ------------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", MODELS)
def test_uni_equals_transformers_with_prefix_hits_and_preemption(checkpoints, model):
    path = checkpoints[model]
    prompts = prompts_for(CONFIGS[MODELS[model]]["vocab_size"])
    with LLM(model=str(path), enable_return_routed_experts=True, block_size=BLOCK) as llm:
        result = rounds(llm, prompts)
    assert result["prefix_hits_tokens"] > 0
    two_sparse_layers(result)
    problems = check_against_hf(path, result)
    assert not problems, "\n".join(problems)
    # The comparison tells positions apart: the same rows one position late disagree.
    r = result["records"][3]
    shifted = dict(r, routed=[r["routed"][0]] + r["routed"][:-1])
    assert check_against_hf(path, {"records": [shifted]})

    hf_config = json.loads((path / "config.json").read_text())
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]
    per_token = 2 * hf_config["num_key_value_heads"] * head_dim * hf_config["num_hidden_layers"] * 4
    with LLM(model=str(path), enable_return_routed_experts=True, block_size=BLOCK, max_model_len=4 * BLOCK,
             kv_cache_memory_bytes=6 * BLOCK * per_token) as llm:  # 6 blocks for sequences of up to 4
        tight = rounds(llm, prompts)
    assert tight["preemptions"] > 0
    problems = check_against_hf(path, tight)
    assert not problems, "\n".join(problems)


def test_off_by_default_and_bad_values(checkpoints):
    with LLM(model=str(checkpoints["mixtral"])) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    assert out[0].outputs[0].routed_experts is None
    with pytest.raises(ConfigError, match="enable_return_routed_experts must be True or False, got 'yes'"):
        LLM(model=str(checkpoints["mixtral"]), enable_return_routed_experts="yes")
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model; LlamaForCausalLM"):
        LLM(enable_return_routed_experts=True)  # the bundled model is dense


# ---- real processes: mp TP 2 x PP 2 + EP, mp DP 2 + EP, torchrun TP 2 + EP x external DP 2 -----------

LAUNCHES = {
    "qwen3moe-mp-tp2-pp2-ep": ("qwen3moe", 1, dict(tensor_parallel_size=2, pipeline_parallel_size=2,
                                                    enable_expert_parallel=True, distributed_executor_backend="mp")),
    "mixtral-mp-dp2-ep": ("mixtral", 1, dict(data_parallel_size=2, enable_expert_parallel=True,
                                             distributed_executor_backend="mp")),
    # a world of 4 for a model of 2 ranks: two external-DP replicas, each rank with its outputs
    "qwen3moe-torchrun-tp2-ep-x2": ("qwen3moe", 4, dict(tensor_parallel_size=2, enable_expert_parallel=True,
                                                          distributed_executor_backend="external_launcher")),
}


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("launch", LAUNCHES)
def test_layouts_equal_transformers(checkpoints, tmp_path, launch):
    model, ranks, layout = LAUNCHES[launch]
    path = checkpoints[model]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts_for(CONFIGS[MODELS[model]]["vocab_size"])))
    args = [REPO / "tests" / "helpers" / "dist_scripts" / "routed_experts.py", path, tmp_path / "prompts.json",
            tmp_path / "out.json", json.dumps(dict(layout, block_size=BLOCK))]
    run = run_torchrun(ranks, args, timeout=180) if ranks > 1 else run_ranks_with_env(1, args, [{}], timeout=180)
    assert run.returncode == 0 and not run.timed_out, run.describe()
    assert not run.leftover_pids and not run.stale_segments(), run.describe()
    outs = [tmp_path / "out.json"] if ranks == 1 else [tmp_path / f"out.json.rank{r}" for r in range(ranks)]
    results = [json.loads(out.read_text()) for out in outs]
    assert all(r["records"] == results[0]["records"] for r in results)  # every rank, every replica
    result = results[0]
    assert result["prefix_hits_tokens"] > 0
    two_sparse_layers(result)
    problems = check_against_hf(path, result)
    assert not problems, "\n".join(problems)
