"""DeepSeek-V3 / V2 through the whole engine against transformers (tiny checkpoints of
tests/helpers/deepseek_checkpoint.py: latent attention with YaRN, grouped routing, shared
experts, two dense layers then two sparse ones).

Greedy tokens and logprobs must equal transformers' teacher-forced ones, and the routing
replay (`routed_experts`) the experts transformers' grouped routers pick. At uni the prompts
are prefilled in chunks, the second round of rollouts hits the prefix cache of the first
(tests/helpers/dist_scripts/routed_experts.py), and a KV cache of a few latent blocks forces
preemption. Slow: the compiled forward and async scheduling at uni; layouts mp TP 2 x PP 2,
mp TP 2 + EP, mp DP 2 + EP (DP waves), torchrun TP 2 x DP 2 + EP (two external-DP replicas of
two ranks).
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch
from deepseek_checkpoint import CONFIGS, make_deepseek_checkpoint
from dist_scripts.routed_experts import rounds
from launch import REPO, run_ranks_with_env, run_torchrun
from test_hf_reference import TIE_MARGIN, engine_outputs, hf_model, prompts_for
from test_moe import CountingSlice, FakeGroup, check_against_hf

from spmd_engine import LLM
from spmd_engine.model.loader import checkpoint_files, read_hf_config
from spmd_engine.model.models.deepseek import DeepseekForCausalLM
from spmd_engine.model.solo import SoloGroup

BLOCK = 8
CHUNKED = dict(block_size=BLOCK, max_num_batched_tokens=8)  # the 17-token prompt prefilled in three steps


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_engine")
    return {name: make_deepseek_checkpoint(root / name, name, seed=40 + i) for i, name in enumerate(("v3", "v2"))}


@functools.lru_cache(maxsize=None)
def cached_hf_model(path):
    return hf_model(path)


@torch.inference_mode()
def hf_rollout(model, ids: list[int]) -> tuple[np.ndarray, torch.Tensor]:
    """transformers on `ids` in one forward: each grouped router's experts per position
    [len(ids), sparse layers, top_k], sorted (its top-k is unsorted), and the logits."""
    picks = []

    def keep(module, args, output):
        picks.append(output[2])
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopkRouter")]
    hooks = [r.register_forward_hook(keep) for r in routers]
    try:
        logits = model(torch.tensor([ids])).logits[0]
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack([p.reshape(len(ids), -1) for p in picks], dim=1).sort(dim=-1).values.numpy(), logits


def rollout_problems(path, result: dict) -> list[str]:
    """Each record's greedy tokens and routed experts against transformers'."""
    problems = []
    for i, r in enumerate(result["records"]):
        seq = r["prompt"] + r["tokens"][:-1]
        ref_routed, logits = hf_rollout(cached_hf_model(path), seq)
        ours = np.sort(np.asarray(r["routed"]), axis=-1)
        if r["dtype"] != "int16" or ours.shape != ref_routed.shape:
            problems.append(f"output {i}: {r['dtype']} {ours.shape}, expected int16 {ref_routed.shape}")
        elif not np.array_equal(ours, ref_routed):
            rows = sorted({int(p) for p in np.argwhere(ours != ref_routed)[:, 0]})
            problems.append(f"output {i}: routed experts at positions {rows} differ from transformers'")
        for step, token in enumerate(r["tokens"]):
            top2 = logits[len(r["prompt"]) - 1 + step].topk(2)
            if token != int(top2.indices[0]) and float(top2.values[0] - top2.values[1]) > TIE_MARGIN:
                problems.append(f"output {i} step {step}: token {token}, transformers' {int(top2.indices[0])}")
    return problems


def latent_bytes_per_token(path) -> int:
    cfg = json.loads((path / "config.json").read_text())
    return cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4


# ---- uni: in this process ------------------------------------------------------------------------

@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["v3", "v2"])
def test_uni_logprobs_tokens_and_routing_equal_transformers(checkpoints, name):
    path = checkpoints[name]
    prompts = prompts_for(CONFIGS[name]["vocab_size"])
    problems = check_against_hf(path, prompts, engine_outputs(path, prompts, **CHUNKED), cached_hf_model(path))
    assert not problems, "\n".join(problems[:10])
    with LLM(model=str(path), enable_return_routed_experts=True, **CHUNKED) as llm:
        result = rounds(llm, prompts)
    assert result["prefix_hits_tokens"] > 0
    assert {np.asarray(r["routed"]).shape[1] for r in result["records"]} == {2}  # layers 2 and 3
    problems = rollout_problems(path, result)
    assert not problems, "\n".join(problems[:10])
    # The comparison tells positions apart: the same rows one position late disagree.
    r = result["records"][3]
    assert rollout_problems(path, {"records": [dict(r, routed=[r["routed"][0]] + r["routed"][:-1])]})
    # Six latent blocks for sequences of up to four: the scheduler must preempt.
    with LLM(model=str(path), enable_return_routed_experts=True, max_model_len=4 * BLOCK, **CHUNKED,
             kv_cache_memory_bytes=6 * BLOCK * latent_bytes_per_token(path)) as llm:
        tight = rounds(llm, prompts)
    assert tight["preemptions"] > 0
    problems = rollout_problems(path, tight)
    assert not problems, "\n".join(problems[:10])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", [dict(enforce_eager=False), dict(async_scheduling=True)],
                         ids=["compiled", "async-scheduling"])
def test_modes_equal_transformers(checkpoints, mode):
    path = checkpoints["v3"]
    prompts = prompts_for(CONFIGS["v3"]["vocab_size"])
    problems = check_against_hf(path, prompts, engine_outputs(path, prompts, **CHUNKED, **mode),
                                cached_hf_model(path))
    assert not problems, "\n".join(problems[:10])


def bytes_read_per_tensor(path, tp_size: int, tp_rank: int, ep: bool) -> dict[str, int]:
    from safetensors import safe_open
    files, log, group = checkpoint_files(path), {}, FakeGroup(tp_size, tp_rank)
    model = DeepseekForCausalLM(read_hf_config(path), group, SoloGroup(), moe_group=group, expert_parallel=ep)

    def fetch(name):
        with safe_open(str(files[name]), framework="pt") as handle:
            return CountingSlice(handle.get_slice(name), name, log)
    model.load_weights(fetch)
    return log


@pytest.mark.timeout(60)
def test_each_rank_reads_its_experts_and_heads_and_the_whole_latent_projections(checkpoints):
    path, c = checkpoints["v3"], CONFIGS["v3"]
    h, heads = c["hidden_size"], c["num_attention_heads"]
    per_expert = 3 * c["moe_intermediate_size"] * h * 4
    for rank in (0, 1):
        log = bytes_read_per_tensor(path, 2, rank, ep=True)
        experts = {int(n.split(".experts.")[1].split(".")[0]) for n in log if ".experts." in n}
        assert experts == set(range(4 * rank, 4 * rank + 4))
        assert sum(v for n, v in log.items() if ".experts." in n) == 2 * 4 * per_expert  # layers 2, 3
        attn = "model.layers.0.self_attn."
        # kv_a (latent + rotary key) and q_a whole on every rank; kv_b, q_b and o_proj by heads.
        assert log[attn + "kv_a_proj_with_mqa.weight"] == (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * h * 4
        assert log[attn + "q_a_proj.weight"] == c["q_lora_rank"] * h * 4
        assert log[attn + "kv_b_proj.weight"] == (heads // 2) * (c["qk_nope_head_dim"] + c["v_head_dim"]) \
            * c["kv_lora_rank"] * 4
        assert log[attn + "o_proj.weight"] == h * (heads // 2) * c["v_head_dim"] * 4
    tp_log = bytes_read_per_tensor(path, 2, 1, ep=False)  # without EP: half of every expert
    assert sum(v for n, v in tp_log.items() if ".experts." in n) == 2 * 8 * per_expert // 2


# ---- real processes -------------------------------------------------------------------------------

LAUNCHES = {
    "v3-mp-tp2-pp2": ("v3", 1, dict(tensor_parallel_size=2, pipeline_parallel_size=2,
                                    distributed_executor_backend="mp")),
    "v2-mp-tp2-ep": ("v2", 1, dict(tensor_parallel_size=2, enable_expert_parallel=True,
                                   distributed_executor_backend="mp")),
    "v2-mp-dp2-ep": ("v2", 1, dict(data_parallel_size=2, enable_expert_parallel=True,
                                   distributed_executor_backend="mp")),  # engine cores in DP waves
    "v3-torchrun-tp2-dp2-ep": ("v3", 4, dict(tensor_parallel_size=2, data_parallel_size=2,
                                             enable_expert_parallel=True,
                                             distributed_executor_backend="external_launcher")),
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("launch", LAUNCHES)
def test_layouts_equal_transformers(checkpoints, tmp_path, launch):
    name, ranks, layout = LAUNCHES[launch]
    path = checkpoints[name]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts_for(CONFIGS[name]["vocab_size"])))
    args = [REPO / "tests" / "helpers" / "dist_scripts" / "routed_experts.py", path, tmp_path / "prompts.json",
            tmp_path / "out.json", json.dumps(dict(layout, **CHUNKED))]
    env = {"OMP_NUM_THREADS": "1"}
    run = (run_torchrun(ranks, args, timeout=280, env_extra=env) if ranks > 1
           else run_ranks_with_env(1, args, [env], timeout=280))
    assert run.returncode == 0 and not run.timed_out, run.describe()
    assert not run.leftover_pids and not run.stale_segments(), run.describe()
    outs = [tmp_path / "out.json"] if ranks == 1 else [tmp_path / f"out.json.rank{r}" for r in range(ranks)]
    results = [json.loads(out.read_text()) for out in outs]
    assert all(r["records"] == results[0]["records"] for r in results)  # every rank, every replica
    assert results[0]["prefix_hits_tokens"] > 0
    problems = rollout_problems(path, results[0])
    assert not problems, "\n".join(problems[:10])
