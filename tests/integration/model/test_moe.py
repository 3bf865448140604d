"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) and dense Qwen3 against transformers.

Tiny random checkpoints, each with an edge case of its family's routing: Mixtral's always
renormalised float32 top-k weights, Qwen2-MoE's shared expert behind a sigmoid gate with
unnormalised top-k and a dense layer from `mlp_only_layers`, Qwen3-MoE's `norm_topk_prob`
with `decoder_sparse_step` 2 and q/k RMSNorm. The engine generates greedily (uni, TP 2 under
mp, TP 2 + expert parallelism under mp and under torchrun) and transformers must agree
token by token and logprob by logprob (teacher-forced, as tests/integration/model/test_hf_reference.py).
Expert parallelism must not change greedy output; each EP rank must read only its experts.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import require_reference
from launch import REPO
from make_random_checkpoint import make_random_checkpoint  # noqa: E402
from test_hf_reference import copy_with_config, disagreements, engine_outputs, hf_logprobs, hf_model, prompts_for

from spmd_engine import LLM, SamplingParams
from spmd_engine.config import ConfigError
from spmd_engine.model.layers.fused_moe import expert_outputs
from spmd_engine.model.layers.moe_routing import route
from spmd_engine.model.loader import checkpoint_files, read_hf_config
from spmd_engine.model.models.llama import CausalLM
from spmd_engine.model.partition import check_model_parallel
from spmd_engine.model.solo import SoloGroup

CONFIGS = {
    "mixtral-4x-top2": dict(
        architecture="MixtralForCausalLM", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_size=48, vocab_size=131, num_experts=4, num_experts_per_tok=2),
    "qwen2moe-shared-unnormalised-mlponly1": dict(
        architecture="Qwen2MoeForCausalLM", hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
        intermediate_size=96, vocab_size=137, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=False, shared_expert_intermediate_size=64, mlp_only_layers=[1]),
    "qwen3moe-normtopk-step2-headdim32": dict(
        architecture="Qwen3MoeForCausalLM", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=32, intermediate_size=96, vocab_size=139, num_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=2),
    "qwen3-dense-qknorm": dict(
        architecture="Qwen3ForCausalLM", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
        intermediate_size=96, vocab_size=149),
}
TP2 = dict(tensor_parallel_size=2)
TP2_EP = dict(tensor_parallel_size=2, enable_expert_parallel=True)
DP2_EP = dict(data_parallel_size=2, enable_expert_parallel=True)  # mp: one world, DP waves, dispatch
CASES = [(name, {}) for name in CONFIGS] + [
    ("mixtral-4x-top2", TP2), ("qwen2moe-shared-unnormalised-mlponly1", TP2_EP), ("qwen3-dense-qknorm", TP2),
    ("qwen3moe-normtopk-step2-headdim32", DP2_EP), ("qwen2moe-shared-unnormalised-mlponly1", DP2_EP),
    ("mixtral-4x-top2", dict(data_parallel_size=2)),  # no EP: each expert's width over DP x TP
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_ref")
    return {name: make_random_checkpoint(root / name, seed=10 + i, **cfg)
            for i, (name, cfg) in enumerate(CONFIGS.items())}


def check_against_hf(path: Path, prompts, outputs, hf=None) -> list[str]:
    hf = hf or hf_model(path)
    problems = []
    for prompt, (tokens, logprobs) in zip(prompts, outputs, strict=True):
        problems += disagreements(prompt, tokens, logprobs, hf_logprobs(hf, prompt, tokens))
    return problems


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name, layout", CASES, ids=[n + "".join(f"-{k.split('_')[0]}{v}" for k, v in l.items())
                                                     for n, l in CASES])
@pytest.mark.slow
def test_engine_matches_transformers(checkpoints, name, layout):
    prompts = prompts_for(CONFIGS[name]["vocab_size"])
    problems = check_against_hf(checkpoints[name], prompts, engine_outputs(checkpoints[name], prompts, **layout))
    assert not problems, "\n".join(problems[:10])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_expert_parallel_keeps_greedy_output_and_matches_transformers(checkpoints):
    """TP 2 with the experts split by width vs whole experts over the EP group: same tokens."""
    name = "qwen3moe-normtopk-step2-headdim32"
    prompts = prompts_for(CONFIGS[name]["vocab_size"])
    tp = engine_outputs(checkpoints[name], prompts, **TP2)
    ep = engine_outputs(checkpoints[name], prompts, **TP2_EP)
    assert [t for t, _ in ep] == [t for t, _ in tp]
    problems = check_against_hf(checkpoints[name], prompts, ep)
    assert not problems, "\n".join(problems[:10])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["ep", "tp"])
def test_torchrun_tp2_matches_transformers(checkpoints, tmp_path, mode):
    from launch import run_torchrun
    name = "mixtral-4x-top2"
    prompts = prompts_for(CONFIGS[name]["vocab_size"])
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    launch = run_torchrun(2, [REPO / "tests" / "helpers" / "dist_scripts" / "moe_generate.py", checkpoints[name],
                              tmp_path / "prompts.json", tmp_path / "out.json", mode], timeout=240)
    assert launch.returncode == 0, launch.describe()
    assert not launch.leftover_pids
    rows = json.loads((tmp_path / "out.json").read_text())

    class Entry:  # the shape of Logprob that `disagreements` reads
        def __init__(self, logprob):
            self.logprob = logprob

    outputs = [(r["tokens"], [{int(t): Entry(v) for t, v in step.items()} for step in r["logprobs"]]) for r in rows]
    problems = check_against_hf(checkpoints[name], prompts, outputs)
    assert not problems, "\n".join(problems[:10])
    assert [t for t, _ in outputs] == [t for t, _ in engine_outputs(checkpoints[name], prompts)]


@pytest.mark.timeout(120)
def test_token_dispatch_across_ranks_with_different_tokens():
    """The all-gather dispatch / all-reduce combine path (DP replicas), 7 tokens vs 1, both shardings."""
    from launch import run_torchrun
    launch = run_torchrun(2, [REPO / "tests" / "helpers" / "dist_scripts" / "moe_dispatch.py"], timeout=100)
    assert launch.returncode == 0, launch.describe()
    ok = sorted(line for line in launch.stdout.splitlines() if line.endswith(" OK"))
    assert ok == ["rank 0 ep experts [0, 1] rows 7 OK", "rank 0 tp experts [0, 1, 2, 3] rows 7 OK",
                  "rank 1 ep experts [2, 3] rows 1 OK", "rank 1 tp experts [0, 1, 2, 3] rows 1 OK"], launch.describe()


# ---- routing and expert compute against the HF modules themselves ----------------------------------

@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_and_experts_equal_hf_blocks(arch, dtype):
    transformers = require_reference("transformers")
    cls = {"mixtral": transformers.MixtralConfig, "qwen3_moe": transformers.Qwen3MoeConfig,
           "qwen2_moe": transformers.Qwen2MoeConfig}[arch]
    cfg = cls(hidden_size=32, intermediate_size=24, moe_intermediate_size=24, num_experts=6, num_local_experts=6,
              num_experts_per_tok=3, norm_topk_prob=arch == "qwen3_moe",
              shared_expert_intermediate_size=16)
    module = getattr(transformers.models, arch)
    block_cls = getattr(module, f"modeling_{arch}").__dict__[
        {"mixtral": "MixtralSparseMoeBlock", "qwen3_moe": "Qwen3MoeSparseMoeBlock",
         "qwen2_moe": "Qwen2MoeSparseMoeBlock"}[arch]]
    torch.manual_seed(0)
    block = block_cls(cfg).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    block = block.to(dtype)
    x = torch.randn(1, 11, 32).to(dtype)
    gate = block.gate.weight
    weights, ids = route(x[0] @ gate.T, 3, renormalize=arch != "qwen2_moe",
                         weights_in_activation_dtype=arch != "mixtral")
    ours = expert_outputs(x[0], weights, ids, block.experts.gate_up_proj, block.experts.down_proj)
    if arch == "qwen2_moe":
        ours = ours + torch.sigmoid(x[0] @ block.shared_expert_gate.weight.T) * block.shared_expert(x[0])
    with torch.no_grad():
        # transformers' experts kernel sums in another order: fp32 within torch's default
        # tolerance (bitwise only with one thread; CI's two threads block the GEMMs
        # differently), bf16 one ulp apart. Unrenormalised routing is off by far more.
        rtol, atol = (1.3e-6, 1e-5) if dtype == torch.float32 else (1.6e-2, 4e-2)
        torch.testing.assert_close(ours, block(x)[0], rtol=rtol, atol=atol)


# ---- negative control: the comparison catches a routing mistake ---------------------------------------

@pytest.mark.timeout(180)
def test_negative_control_routing_without_renormalisation_fails(checkpoints, tmp_path):
    """Our renormalised Qwen3-MoE output checked against a transformers model that skips the
    renormalisation (norm_topk_prob false): the HF comparison must report disagreements."""
    name = "qwen3moe-normtopk-step2-headdim32"
    prompts = prompts_for(CONFIGS[name]["vocab_size"])
    outputs = engine_outputs(checkpoints[name], prompts)
    wrong = copy_with_config(checkpoints[name], tmp_path / "wrong", norm_topk_prob=False)
    assert not check_against_hf(checkpoints[name], prompts, outputs)
    assert check_against_hf(wrong, prompts, outputs)


# ---- expert placement: each EP rank reads exactly its experts ------------------------------------------

class FakeGroup(SoloGroup):
    """A group of `size` ranks seen from `rank`: enough to build and load one rank's shard in-process."""

    def __init__(self, size: int, rank: int):
        self.world_size, self.rank_in_group, self.ranks = size, rank, list(range(size))


class CountingSlice:
    """A safetensors slice that counts the bytes each index reads."""

    def __init__(self, inner, name, log):
        self.inner, self.name, self.log = inner, name, log

    def get_shape(self):
        return self.inner.get_shape()

    def __getitem__(self, index):
        out = self.inner[index]
        self.log[self.name] = self.log.get(self.name, 0) + out.numel() * out.element_size()
        return out


def bytes_read_per_tensor(path: Path, tp_size: int, tp_rank: int, ep: bool) -> dict[str, int]:
    from safetensors import safe_open
    files, log = checkpoint_files(path), {}
    group = FakeGroup(tp_size, tp_rank)
    model = CausalLM(read_hf_config(path), group, SoloGroup(), moe_group=group, expert_parallel=ep)

    def fetch(name):
        with safe_open(str(files[name]), framework="pt") as handle:
            return CountingSlice(handle.get_slice(name), name, log)

    model.load_weights(fetch)
    return log


def test_each_ep_rank_reads_only_its_experts(checkpoints):
    path = checkpoints["qwen2moe-shared-unnormalised-mlponly1"]  # 8 experts, layers 0 and 2 sparse
    per_expert = 3 * 32 * 64 * 4  # gate, up, down of one expert, float32
    for rank in (0, 1):
        log = bytes_read_per_tensor(path, 2, rank, ep=True)
        experts = {int(n.split(".experts.")[1].split(".")[0]) for n in log if ".experts." in n}
        assert experts == set(range(4 * rank, 4 * rank + 4))
        expert_bytes = sum(v for n, v in log.items() if ".experts." in n)
        assert expert_bytes == 2 * 4 * per_expert  # 2 sparse layers x 4 whole experts
    tp_log = bytes_read_per_tensor(path, 2, 1, ep=False)  # without EP: half of every expert
    assert {int(n.split(".experts.")[1].split(".")[0]) for n in tp_log if ".experts." in n} == set(range(8))
    assert sum(v for n, v in tp_log.items() if ".experts." in n) == 2 * 8 * per_expert // 2


def test_expert_placement_counts_parameters(checkpoints):
    path = checkpoints["mixtral-4x-top2"]
    model = CausalLM(read_hf_config(path), FakeGroup(2, 1), SoloGroup(), moe_group=FakeGroup(2, 1),
                     expert_parallel=True)
    experts = model.model.layers["0"].mlp.experts
    assert list(experts.local_experts) == [2, 3]
    assert tuple(experts.w13_weight.shape) == (2, 2 * 48, 64) and tuple(experts.w2_weight.shape) == (2, 64, 48)


# ---- bad input ----------------------------------------------------------------------------------------

def test_bad_expert_layouts_name_the_numbers(checkpoints):
    config = read_hf_config(checkpoints["qwen3moe-normtopk-step2-headdim32"])
    with pytest.raises(ConfigError, match="num_experts 8 .* not divisible by the expert parallel size 3"):
        check_model_parallel(config, 1, 1, ep_size=3)
    with pytest.raises(ConfigError, match="num_experts_per_tok 9 exceeds the number of experts 8"):
        check_model_parallel(dict(config, num_experts_per_tok=9), 1, 1)
    with pytest.raises(ConfigError, match="tensor_parallel_size 3 must divide the expert intermediate size 32"):
        check_model_parallel(dict(config, num_attention_heads=3, num_key_value_heads=3, head_dim=32,
                                  intermediate_size=99), 3, 1)


@pytest.mark.timeout(60)
def test_cli_exits_2_when_experts_do_not_split_over_ep(checkpoints, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(checkpoints["mixtral-4x-top2"], bad)
    config = json.loads((bad / "config.json").read_text())
    config["num_local_experts"] = 3
    config["num_experts_per_tok"] = 2
    (bad / "config.json").write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, "-m", "spmd_engine.run", "--model", str(bad), "-tp", "2",
                           "--enable-expert-parallel", "--prompt", "hi", "--quiet"],
                          capture_output=True, text=True, timeout=50, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    assert "num_experts 3" in proc.stderr and "expert parallel size 2" in proc.stderr


@pytest.mark.timeout(60)
def test_expert_parallel_on_a_dense_model_warns_once_and_changes_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="spmd_engine"):
        with LLM(enable_expert_parallel=True) as llm:
            with_ep = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0].token_ids
    warnings = [r for r in caplog.records if "enable_expert_parallel has no effect" in r.getMessage()]
    assert len(warnings) == 1
    with LLM() as llm:
        assert llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0].token_ids == with_ep


# ---- plan ---------------------------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_plan_shows_moe_traffic_and_experts_per_ep_rank(checkpoints, tmp_path):
    def plan(*args):
        return subprocess.run([sys.executable, "-m", "spmd_engine.plan", *args], capture_output=True, text=True,
                              timeout=50, cwd=REPO)

    model = str(checkpoints["qwen3moe-normtopk-step2-headdim32"])
    out = plan("-tp", "2", "-dp", "2", "--enable-expert-parallel", "--distributed-executor-backend",
               "external_launcher", "--model", model, "--json")
    assert out.returncode == 0, out.stderr
    moe = json.loads(out.stdout)["moe"]
    assert moe["experts_per_rank"] == {"0": [0, 1], "1": [2, 3], "2": [4, 5], "3": [6, 7]}
    assert [t["group"] for t in moe["traffic_per_sparse_layer"]] == ["dp", "ep"]
    text = plan("-tp", "2", "--model", model).stdout
    assert "tp  all_reduce of expert outputs" in text and "expert width per rank: 16" in text
    no_ep = json.loads(plan("-tp", "2", "-dp", "2", "--model", model, "--json").stdout)["moe"]
    assert no_ep["width_over_dp"] and [t["group"] for t in no_ep["traffic_per_sparse_layer"]] == ["dp", "ep"]
    assert no_ep["expert_width_per_rank"] == 8  # 32 over DP 2 x TP 2
    three = plan("-tp", "2", "-dp", "3", "--enable-expert-parallel", "--model", str(checkpoints["mixtral-4x-top2"]))
    assert three.returncode == 2 and "num_experts 4" in three.stderr and "expert parallel size 6" in three.stderr


def test_update_weights_reaches_only_the_expert_holders(checkpoints):
    """A trainer's full HF-named tensors (RL weight sync): each EP rank copies its own experts'
    tensors and skips the others'; with packing on, the packed experts follow the update."""
    from safetensors.torch import load_file

    from spmd_engine.kernels.packed_weights import pack_linear_weights
    path = checkpoints["qwen3moe-normtopk-step2-headdim32"]  # sparse layers 1 and 3, 8 experts
    state = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.mlp.experts.5.down_proj.weight"
    for rank in (0, 1):
        group = FakeGroup(2, rank)
        model = CausalLM(read_hf_config(path), group, SoloGroup(), moe_group=group, expert_parallel=True)
        model.update_weights(state)
        pack_linear_weights(model, 8)
        experts = model.model.layers["1"].mlp.experts
        x = torch.randn(3, 64)
        ids, weights = torch.full((3, 1), 5), torch.ones(3, 1)
        before = experts.compute(x, weights, ids)
        copied = model.update_weights([(name, state[name] * 2)])
        assert copied == ({name} if rank == 1 else set())
        torch.testing.assert_close(experts.compute(x, weights, ids), before * 2 if rank == 1 else before)
