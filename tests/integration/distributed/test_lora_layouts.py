"""LoRA adapters on every layout, against transformers + PEFT: mp TP2 x PP2 in this process and a
torchrun TP2 x DP2 launch (two external-DP replicas of two ranks); each mixes the base model and
two adapters in one batch, then pushes an adapter in place from tensors (lora_layouts.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from lora_helpers import make_adapter, peft_model, reference_greedy, reference_logprobs

import spmd_engine
from spmd_engine import LLM
from tests.helpers.launch import run_torchrun

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers" / "dist_scripts"))
from lora_layouts import workload  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "helpers" / "dist_scripts" / "lora_layouts.py"
BUNDLED = Path(spmd_engine.__file__).parent / "bundled"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"a": str(make_adapter(BUNDLED, root / "a", r=8, alpha=16, seed=1, scale=0.6)),
            "b": str(make_adapter(BUNDLED, root / "b", r=16, alpha=8, rslora=True, seed=2, scale=0.8,
                                  targets=["q_proj", "v_proj", "o_proj", "down_proj"]))}


@pytest.fixture(scope="module")
def references(adapters):
    from transformers import AutoModelForCausalLM
    models = {None: AutoModelForCausalLM.from_pretrained(str(BUNDLED), dtype=torch.float32).eval()}
    models.update({name: peft_model(BUNDLED, path) for name, path in adapters.items()})
    return models


def check(results, references):
    assert len({tuple(r["tokens"]) for r in results}) > 3, "the adapters must change the tokens"
    for r in results:
        model = references[r["adapter"]]
        assert r["tokens"] == reference_greedy(model, r["prompt"], len(r["tokens"])), r["adapter"]
        want = reference_logprobs(model, r["prompt"], r["tokens"])
        assert max(abs(a - b) for a, b in zip(r["logprobs"], want)) < 1e-4, r["adapter"]


@pytest.mark.timeout(300)
def test_mp_tp2_pp2_matches_peft(adapters, references):
    with LLM(distributed_executor_backend="mp", tensor_parallel_size=2, pipeline_parallel_size=2, enable_lora=True,
             max_loras=2, dtype="float32", enforce_eager=True) as llm:
        check(workload(llm, adapters), references)


@pytest.mark.timeout(300)
def test_torchrun_tp2_dp2_matches_peft_on_both_replicas(adapters, references, tmp_path):
    plan = {"adapters": adapters, "layout": {"tensor_parallel_size": 2, "data_parallel_size": 2}}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    launch = run_torchrun(4, [SCRIPT, tmp_path / "plan.json", tmp_path], timeout=240,
                          env_extra={"OMP_NUM_THREADS": "1"})
    assert launch.returncode == 0 and not launch.timed_out, launch.describe()
    replicas = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 2)]
    assert replicas[0] == replicas[1]
    check(replicas[0], references)
