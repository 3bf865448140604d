"""Phi-3 and OLMo 2 sharded: mp TP2 x PP2 and torchrun TP2 x DP2 against transformers, the
TP-invariance of batch-invariant mode, and OLMo 2's whole-projection q/k norm across TP ranks.

TP 2 is where OLMo 2's norm bites: each rank holds half of q's and k's heads, and the norm's
mean runs over all of them. The negative control normalises each rank's half alone and must
be caught by the same comparison. Checkpoints, prompts and the check come from
test_dense_families.py.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from fake_groups import SoloGroup, make_grid_groups, run_distributed
from family_checkpoints import olmo2_config, phi3_config, save_random
from launch import REPO, run_torchrun
from test_dense_families import FAMILIES, crossing_prompts, generate, generate_problems, problems_against, prompts
from test_hf_reference import hf_model

from spmd_engine import LLM, SamplingParams

sys.path.insert(0, str(REPO / "tests" / "helpers" / "dist_scripts"))
from batch_invariant_layouts import workload  # noqa: E402

SCRIPT = REPO / "tests" / "helpers" / "dist_scripts" / "family_generate.py"
pytestmark = pytest.mark.slow  # every test here launches ranks


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dense_layouts")
    return {"phi3": save_random(phi3_config(), root / "phi3", seed=0),
            "olmo2": save_random(olmo2_config(), root / "olmo2", seed=1)}


class Entry:  # the shape of Logprob that `disagreements` reads
    def __init__(self, logprob):
        self.logprob = logprob


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", FAMILIES)
def test_mp_tp2_pp2_matches_transformers(checkpoints, name):
    """With Phi-3's generations that cross the original context too (recomputed on every rank)."""
    crossing = crossing_prompts()
    outputs = generate(checkpoints[name], prompts() + crossing, tensor_parallel_size=2, pipeline_parallel_size=2)
    hf = hf_model(checkpoints[name])
    problems = problems_against(hf, prompts(), outputs[:len(prompts())])
    problems += generate_problems(hf, crossing, outputs[len(prompts()):])
    assert not problems, "\n".join(problems[:10])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", FAMILIES)
def test_torchrun_tp2_dp2_matches_transformers_on_both_replicas(checkpoints, name, tmp_path):
    (tmp_path / "prompts.json").write_text(json.dumps(prompts()))
    (tmp_path / "layout.json").write_text(json.dumps({"tensor_parallel_size": 2, "data_parallel_size": 2}))
    launch = run_torchrun(4, [SCRIPT, checkpoints[name], tmp_path / "prompts.json", tmp_path / "layout.json",
                              tmp_path], timeout=240, env_extra={"OMP_NUM_THREADS": "1"})
    assert launch.returncode == 0 and not launch.timed_out and not launch.leftover_pids, launch.describe()
    assert not launch.stale_segments()
    replicas = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 2)]
    assert replicas[0] == replicas[1]
    outputs = [(r["tokens"], [{int(t): Entry(v) for t, v in step.items()} for step in r["logprobs"]])
               for r in replicas[0]]
    problems = problems_against(hf_model(checkpoints[name]), prompts(), outputs)
    assert not problems, "\n".join(problems[:10])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", FAMILIES)
def test_batch_invariant_tp2_equals_tp1_bitwise(checkpoints, name):
    runs = []
    for layout in ({}, {"tensor_parallel_size": 2}):
        with LLM(model=str(checkpoints[name]), batch_invariant=True, enforce_eager=True, **layout) as llm:
            runs.append(workload(llm, 131))
    assert runs[0] == runs[1]


def _tp_logits(rank: int, world_size: int, path: str, per_rank_norm: bool,
               batch_invariant: bool = False) -> torch.Tensor:
    from spmd_engine.model.layers.sharded_norm import ShardedRMSNorm
    from spmd_engine.model.loader import load_model
    tp, _ = make_grid_groups(world_size, 1)
    model = load_model(path, tp, SoloGroup(), dtype=torch.float32, batch_invariant=batch_invariant)
    if per_rank_norm:  # the bug the test must catch: each rank's heads normalised alone
        for module in model.modules():
            if isinstance(module, ShardedRMSNorm):
                module.tp_size = 1
    ids = torch.arange(3, 40).remainder(131)[None]
    with torch.no_grad():
        hidden = model(ids, torch.arange(ids.shape[1])[None], None)["hidden_states"]
        return model.compute_logits(hidden[0])


@pytest.mark.timeout(180)
def test_olmo2_norm_over_the_whole_projection_at_tp2(checkpoints):
    """Rank-local logits at TP 2 equal transformers'; normalising per rank does not."""
    path = str(checkpoints["olmo2"])
    with torch.no_grad():
        ref = hf_model(checkpoints["olmo2"])(torch.arange(3, 40).remainder(131)[None]).logits[0]
    right = run_distributed(_tp_logits, 2, path, False, timeout=120)
    wrong = run_distributed(_tp_logits, 2, path, True, timeout=120)
    for logits in right:
        assert (logits - ref).abs().max() < 1e-4
    for logits in wrong:
        assert (logits - ref).abs().max() > 1e-2


@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", FAMILIES)
def test_compiled_tp2_equals_eager(checkpoints, name):
    """The compiled forward runs the families' decoder layers (OLMo 2's norm all-reduce is the
    opaque op inside the graph) and gives eager's tokens."""
    prompt_list = prompts() + crossing_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    runs = []
    for compiled in (False, True):
        options = dict(enforce_eager=False, compilation_config={"level": 3, "min_tokens": 2}) if compiled \
            else dict(enforce_eager=True)
        with LLM(model=str(checkpoints[name]), tensor_parallel_size=2, **options) as llm:
            runs.append([o.outputs[0].token_ids for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompt_list], params)])
            graphs = llm.get_stats()[0]["runner"]["compiled_graphs"]
        assert (graphs > 0) == compiled
    assert runs[0] == runs[1]


@pytest.mark.timeout(240)
def test_olmo2_norm_with_replicated_kv_heads_at_tp4(checkpoints):
    """TP 4 over 2 KV heads: each k head on two ranks. Its squares count once in the mean, in
    the all-reduce form and in batch-invariant mode, which also gives TP 1's bits."""
    path = str(checkpoints["olmo2"])
    with torch.no_grad():
        ref = hf_model(checkpoints["olmo2"])(torch.arange(3, 40).remainder(131)[None]).logits[0]
    for batch_invariant in (False, True):
        for logits in run_distributed(_tp_logits, 4, path, False, batch_invariant, timeout=200):
            assert (logits - ref).abs().max() < 1e-4, batch_invariant
    solo = run_distributed(_tp_logits, 1, path, False, True, timeout=100)[0]
    assert torch.equal(logits, solo)
