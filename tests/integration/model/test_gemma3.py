"""Gemma 3 text (`Gemma3ForCausalLM`) against transformers, on a tiny random checkpoint with every
feature on (tests/helpers/gemma_checkpoint.py): prompts and generations run past the sliding
window, both rope kinds scaled, softcapped logits. The engine generates greedily with logprobs
and transformers scores the same sequences (teacher forcing, as test_hf_reference.py): every
token its argmax, every logprob within fp32 tolerance. Quick: uni, the config errors, and the
negative controls (the same outputs disagree with a reference that drops the window, the local
rope's scaling or the softcap). Slow: the engine's paths (chunked prefill, prefix-cache hits,
preemption, batch-invariant mode, the compiled path), mp TP2 x PP2, torchrun TP2 x DP2, and
`plan`'s per-rank weight bytes against a real launch.
"""

from __future__ import annotations

import json
import sys

import pytest
from gemma_checkpoint import CONFIG, WINDOW, make_gemma3_checkpoint
from inductor_cache import shared_cache_dir
from launch import REPO, run_torchrun
from test_hf_reference import copy_with_config, disagreements, engine_outputs, hf_logprobs, hf_model

from spmd_engine.config import ConfigError
from spmd_engine.model.spec import ModelSpec

sys.path.insert(0, str(REPO / "tests" / "helpers" / "dist_scripts"))
from gemma3_layouts import PROMPTS  # noqa: E402

SCRIPT = REPO / "tests" / "helpers" / "dist_scripts" / "gemma3_layouts.py"
assert min(len(p) for p in PROMPTS[1:]) > WINDOW  # all but the first prompt outrun the window


@pytest.fixture(scope="module", autouse=True)
def inductor_cache(tmp_path_factory):
    """The run's shared cache (tests/helpers/inductor_cache.py), inherited by mp workers."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(shared_cache_dir(tmp_path_factory)))
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_gemma3_checkpoint(tmp_path_factory.mktemp("gemma3") / "ckpt")


@pytest.fixture(scope="module")
def reference(checkpoint):
    return hf_model(checkpoint)


@pytest.fixture(scope="module")
def uni_outputs(checkpoint):
    return engine_outputs(checkpoint, PROMPTS, enforce_eager=True)  # the compiled path: slow suite


def problems_of(outputs, reference, prompts=PROMPTS) -> list[str]:
    problems = []
    for prompt, (tokens, logprobs) in zip(prompts, outputs, strict=True):
        problems += disagreements(prompt, tokens, logprobs, hf_logprobs(reference, prompt, tokens))
    return problems


@pytest.mark.timeout(180)
def test_uni_matches_transformers(uni_outputs, reference):
    assert not problems_of(uni_outputs, reference)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("change", [
    dict(sliding_window=4096),  # every layer global
    dict(rope_parameters={**CONFIG["rope_parameters"],
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}),
    dict(final_logit_softcapping=None),
], ids=["no-window", "local-rope-unscaled", "no-softcap"])
def test_negative_control_reference_without_a_feature_disagrees(checkpoint, uni_outputs, change, tmp_path):
    """The comparison sees each feature: our outputs fail against a reference that drops it."""
    wrong = hf_model(copy_with_config(checkpoint, tmp_path / "wrong", **change))
    assert problems_of(uni_outputs, wrong)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("change, field", [
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(hidden_activation="gelu"), "hidden_activation"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(layer_types=["sliding_attention"]), "layer_types"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(query_pre_attn_scalar=-1), "query_pre_attn_scalar"),
    (dict(architectures=["Gemma3ForConditionalGeneration"]), "Gemma3ForConditionalGeneration"),
])
def test_unsupported_config_is_one_line_naming_the_field(change, field):
    cfg = {**CONFIG, "architectures": ["Gemma3ForCausalLM"], **change}
    with pytest.raises(ConfigError) as err:
        ModelSpec.from_hf_config(cfg)
    assert field in str(err.value) and "\n" not in str(err.value)


@pytest.mark.timeout(60)
def test_spec_reads_each_layer_kind():
    spec = ModelSpec.from_hf_config({**CONFIG, "architectures": ["Gemma3ForCausalLM"]})
    assert spec.layer_windows == (WINDOW, None, WINDOW, WINDOW)
    assert (spec.rope_theta, dict(spec.rope_scaling)["factor"]) == (100000.0, 4.0)
    assert (spec.local_rope_theta, dict(spec.local_rope_scaling)["factor"]) == (1000.0, 2.0)
    # Older configs: rope_theta / rope_scaling for global layers, rope_local_base_freq for local
    # ones, every sliding_window_pattern-th layer global.
    old = {k: v for k, v in CONFIG.items() if k not in ("rope_parameters", "layer_types")}
    spec = ModelSpec.from_hf_config({**old, "architectures": ["Gemma3ForCausalLM"], "rope_theta": 1e6,
                                     "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                                     "rope_local_base_freq": 1e4, "sliding_window_pattern": 2})
    assert spec.layer_windows == (WINDOW, None, WINDOW, None)
    assert (spec.rope_theta, dict(spec.rope_scaling)["factor"], spec.local_rope_theta) == (1e6, 8.0, 1e4)


# Three more requests that grow past one block: with four blocks of 16 tokens some are preempted.
CROWD = PROMPTS + [[(13 * i + k) % 131 for i in range(6)] for k in (2, 4, 6)]
ENGINE_PATHS = [
    (dict(max_num_batched_tokens=16), PROMPTS),  # chunked prefill: the 21-token prompt over two steps
    # 2048 bytes of K/V per token; chunks of 16 admit the crowd's prompts together, their growth preempts
    (dict(kv_cache_memory_bytes=4 * 16 * 2048, max_model_len=48, max_num_batched_tokens=16), CROWD),
    (dict(batch_invariant=True), PROMPTS),
    (dict(enforce_eager=False, compilation_config={"level": 3, "min_tokens": 2}), PROMPTS),  # compiled layers
]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("settings, prompts", ENGINE_PATHS, ids=["chunked", "preempt", "batch-invariant", "compiled"])
def test_engine_paths_match_transformers(checkpoint, reference, settings, prompts):
    from spmd_engine import LLM, SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)
    with LLM(model=str(checkpoint), **settings) as llm:
        outs = llm.generate(prompts, params)
        again = llm.generate(prompts, params)  # the prefix cache's second pass
        stats = llm.get_stats()
    for run in (outs, again):
        assert not problems_of([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in run], reference, prompts)
    if "kv_cache_memory_bytes" in settings:
        assert stats[0]["num_blocks"] == 4 and stats[0]["preemptions"] > 0
    else:
        assert any(o.num_cached_tokens > 0 for o in again)  # prefix-cache hits past the window
    if "compilation_config" in settings:  # both layer kinds, each its graph
        assert stats[0]["runner"]["compiled_graphs"] + stats[0]["runner"]["compiled_graphs_loaded"] >= 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mp_tp2_pp2_matches_transformers(checkpoint, reference):
    outputs = engine_outputs(checkpoint, PROMPTS, distributed_executor_backend="mp", tensor_parallel_size=2,
                             pipeline_parallel_size=2)
    assert not problems_of(outputs, reference)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_tp2_dp2_matches_transformers_on_both_replicas(checkpoint, reference, tmp_path):
    plan = {"model": str(checkpoint), "layout": {"tensor_parallel_size": 2, "data_parallel_size": 2}}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    launch = run_torchrun(4, [SCRIPT, tmp_path / "plan.json", tmp_path], timeout=240,
                          env_extra={"OMP_NUM_THREADS": "1"})
    assert launch.returncode == 0 and not launch.timed_out, launch.describe()
    assert not launch.stale_segments()
    replicas = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 2)]
    assert replicas[0] == replicas[1]
    outputs = [(r["tokens"], [{int(t): _Logprob(v) for t, v in d.items()} for d in r["logprobs"]])
               for r in replicas[0]]
    assert not problems_of(outputs, reference)


class _Logprob:
    """A returned logprob read back from JSON (disagreements reads `.logprob`)."""

    def __init__(self, value: float):
        self.logprob = value


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_plan_per_rank_weights_equal_a_real_launch(checkpoint, tmp_path, monkeypatch):
    from tests.e2e.test_plan_memory import KV, plan_memory
    layouts = {"tp2-pp2": dict(tensor_parallel_size=2, pipeline_parallel_size=2),
               "tp4": dict(tensor_parallel_size=4)}
    cases = [{"name": name, "model": str(checkpoint), "llm": {**kwargs, **KV}, "env": {}}
             for name, kwargs in layouts.items()]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    launch = run_torchrun(4, [REPO / "tests" / "helpers" / "dist_scripts" / "rank_memory.py",
                              tmp_path / "cases.json", tmp_path], timeout=240, env_extra={"OMP_NUM_THREADS": "1"})
    assert launch.returncode == 0 and not launch.leftover_pids, launch.describe()
    measured = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for name, kwargs in layouts.items():
        planned = plan_memory(checkpoint, kwargs, monkeypatch, {})["per_rank"]
        assert [r["weight_bytes"] for r in planned] == [m[name]["weight_bytes"] for m in measured], name
        # The KV groups' pools (core/kv_groups.py) sized alike by the plan and the workers.
        assert [r["kv_blocks"] for r in planned] == [m[name]["kv_blocks"] for m in measured], name
    # Not vacuous: PP's stages hold other layers (the first stage the embedding, which the last ties).
    assert len({m["tp2-pp2"]["weight_bytes"] for m in measured}) == 2
