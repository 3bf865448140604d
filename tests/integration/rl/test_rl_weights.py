"""In-place weight updates for RL trainers (issue 13): `model.load_weights(pairs)` where trainers
reach it, `collective_rpc("load_weights" | "reload_weights")`, `load_format="dummy"`, and the
prefix cache reset that must follow an update.

Two tiny random checkpoints (seeds 0 and 1) stand for the weights before and after an
optimizer step: after loading the second one's tensors into an engine started on the first,
greedy outputs must equal a fresh engine on the second, token for token.
"""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import make_tiny_checkpoint, reference_greedy
from safetensors.torch import load_file

from spmd_engine import LLM, SamplingParams
from spmd_engine.kernels.packed_weights import is_packed

# The first prompt spans two full 16-token blocks: a second generate hits the prefix cache.
PROMPTS = [list(range(1, 40)), [4, 5, 6, 7, 8], [9, 10]]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    old = make_tiny_checkpoint(tmp_path_factory.mktemp("old"), seed=0)
    new = make_tiny_checkpoint(tmp_path_factory.mktemp("new"), seed=1)
    return old, new


@pytest.fixture(scope="module")
def tied_ckpts(tmp_path_factory):
    old = make_tiny_checkpoint(tmp_path_factory.mktemp("tied_old"), seed=0, tie_word_embeddings=True)
    new = make_tiny_checkpoint(tmp_path_factory.mktemp("tied_new"), seed=1, tie_word_embeddings=True)
    return old, new


def tensors(ckpt) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt / "model.safetensors"))


def expected(ckpt) -> list[list[int]]:
    return [reference_greedy(ckpt, p, MAX_TOKENS) for p in PROMPTS]


def tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def driver_model(llm):
    return llm.llm_engine.model_executor.driver_worker.model_runner.model


@pytest.mark.timeout(120)
@pytest.mark.parametrize("packed", ["1", "0"], ids=["packed", "dense"])
@pytest.mark.parametrize("how", ["all_at_once", "one_at_a_time_shuffled"])
def test_uni_load_weights_equals_a_fresh_engine_on_the_new_checkpoint(ckpts, packed, how, monkeypatch):
    monkeypatch.setenv("SPMD_ENGINE_CPU_PACKED_WEIGHTS", packed)
    old, new = ckpts
    new_tensors = tensors(new)
    with LLM(model=str(old), max_model_len=64) as llm:
        assert tokens(llm) == expected(old)
        model = driver_model(llm)
        # Both of the paths trainers use reach the same model.
        assert llm.llm_engine.model_executor.driver_worker.worker.model_runner.model is model
        if packed == "1":
            assert is_packed(model.model.layers["0"].self_attn.qkv_proj.weight)  # oneDNN's or the kernel's layout
        if how == "all_at_once":
            loaded = model.load_weights(new_tensors.items())
        else:
            names = list(new_tensors)
            random.Random(0).shuffle(names)
            loaded = set()
            for name in names:
                loaded |= model.load_weights([(name, new_tensors[name])])
        assert loaded == set(new_tensors)
        assert llm.reset_prefix_cache()
        assert tokens(llm) == expected(new)


@pytest.mark.timeout(120)
def test_uni_tied_embeddings_update_the_head_too(tied_ckpts):
    old, new = tied_ckpts
    new_tensors = tensors(new)
    assert "lm_head.weight" not in new_tensors
    with LLM(model=str(old), max_model_len=64) as llm:
        assert tokens(llm) == expected(old)
        # A trainer's state dict of a tied model names the shared matrix twice: both are accepted.
        pairs = list(new_tensors.items()) + [("lm_head.weight", new_tensors["model.embed_tokens.weight"])]
        assert driver_model(llm).load_weights(pairs) == set(new_tensors) | {"lm_head.weight"}
        llm.reset_prefix_cache()
        assert tokens(llm) == expected(new)


@pytest.mark.timeout(120)
def test_stale_prefix_cache_until_reset(ckpts):
    """The KV cache keeps the old weights' keys and values: without reset_prefix_cache a cached
    prompt is continued from stale KV; after it, outputs are the new weights' own."""
    old, new = ckpts
    with LLM(model=str(old), max_model_len=64) as llm:
        tokens(llm)
        driver_model(llm).load_weights(tensors(new).items())
        before = llm.get_stats()[0]["prefix_hits_tokens"]
        stale = tokens(llm)
        assert llm.get_stats()[0]["prefix_hits_tokens"] > before  # the first prompt's blocks were reused
        assert stale[0] != expected(new)[0]
        assert llm.reset_prefix_cache()
        assert tokens(llm) == expected(new)


@pytest.mark.timeout(120)
def test_dummy_load_format_reads_no_checkpoint_and_takes_weights_later(ckpts, tmp_path):
    old, new = ckpts
    # A directory with the config only: the dummy format must not look for tensors.
    bare = tmp_path / "config_only"
    bare.mkdir()
    (bare / "config.json").write_text((new / "config.json").read_text())
    with LLM(model=str(bare), max_model_len=64, load_format="dummy") as llm:
        random_tokens = tokens(llm)
        assert random_tokens != expected(new)
        loaded = llm.collective_rpc("load_weights", args=(list(tensors(new).items()),))
        assert loaded == [set(tensors(new))]
        llm.reset_prefix_cache()
        assert tokens(llm) == expected(new)


@pytest.mark.timeout(120)
def test_reload_weights_keeps_a_trainers_update_and_restores_discarded_weights(ckpts):
    """TRL calls reload_weights after every weight sync (its workaround for vllm#29341): after a
    load it keeps the loaded weights; only weights discarded by sleep(2), with nothing loaded
    since, are read from the model directory again."""
    old, new = ckpts
    with LLM(model=str(old), max_model_len=64, enable_sleep_mode=True) as llm:
        driver_model(llm).load_weights(tensors(new).items())
        llm.reset_prefix_cache()
        assert tokens(llm) == expected(new)
        assert llm.collective_rpc("reload_weights") == [set()]
        llm.reset_prefix_cache()
        assert tokens(llm) == expected(new)
        llm.sleep(level=2)
        assert llm.collective_rpc("reload_weights") == [set(tensors(old))]
        llm.wake_up()
        assert tokens(llm) == expected(old)


@pytest.mark.timeout(120)
def test_bad_weights_are_named_and_the_engine_keeps_working(ckpts):
    old, new = ckpts
    good = tensors(new)
    with LLM(model=str(old), max_model_len=64) as llm:
        want = tokens(llm)
        model = driver_model(llm)
        bad_shape = [("model.layers.1.self_attn.k_proj.weight", torch.zeros(3, 64))]
        unknown = [("model.layers.1.self_attn.kk_proj.weight", torch.zeros(16, 64))]
        beyond = [("model.layers.4.mlp.up_proj.weight", good["model.layers.0.mlp.up_proj.weight"])]
        for pairs, named in ((bad_shape, r"k_proj.weight has shape \[3, 64\], expected \[16, 64\]"),
                             (unknown, "unknown weight name 'model.layers.1.self_attn.kk_proj.weight'"),
                             (beyond, "unknown weight name 'model.layers.4.mlp.up_proj.weight'")):
            with pytest.raises(ValueError, match=named):
                model.load_weights(pairs)
            with pytest.raises(ValueError, match=named):
                llm.collective_rpc("load_weights", args=(pairs,))
        with pytest.raises(ValueError, match="load_format 'nope'"):
            LLM(model=str(old), load_format="nope")
        llm.reset_prefix_cache()
        assert tokens(llm) == want


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)],
                         ids=["tp2", "pp2"])
def test_mp_collective_rpc_load_and_reload(ckpts, layout):
    old, new = ckpts
    new_tensors = tensors(new)
    with LLM(model=str(old), max_model_len=64, distributed_executor_backend="mp", enable_sleep_mode=True,
             **layout) as llm:
        assert tokens(llm) == expected(old)
        loaded = llm.collective_rpc("load_weights", args=(list(new_tensors.items()),))
        if layout.get("pipeline_parallel_size") == 2:
            # Each stage copied only its own layers (2 each), the embedding on the first and the
            # norm and head on the last; together every tensor, once.
            first, last = loaded
            assert {n for n in first if ".layers." in n} == {n for n in new_tensors if ".layers.0." in n
                                                             or ".layers.1." in n}
            assert {n for n in last if ".layers." in n} == {n for n in new_tensors if ".layers.2." in n
                                                            or ".layers.3." in n}
            assert "model.embed_tokens.weight" in first and "lm_head.weight" not in first
            assert "model.norm.weight" in last and "model.embed_tokens.weight" not in last
            assert not first & last and first | last == set(new_tensors)
        else:
            assert loaded == [set(new_tensors)] * 2
        llm.reset_prefix_cache()
        assert tokens(llm) == expected(new)
        with pytest.raises(ValueError, match="unknown weight name 'lm_head.bias'"):
            llm.collective_rpc("load_weights", args=([("lm_head.bias", torch.zeros(300))],))
        assert llm.collective_rpc("reload_weights") == [set(), set()]  # every worker keeps the update
        llm.reset_prefix_cache()
        assert tokens(llm) == expected(new)
        llm.sleep(level=2)  # back to the checkpoint: discard, then reload
        llm.collective_rpc("reload_weights")
        llm.wake_up()
        assert tokens(llm) == expected(old)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torchrun_tp2_pp2_each_rank_loads_its_stage_and_matches_the_new_checkpoint(ckpts):
    import json

    from launch import REPO, run_torchrun
    old, new = ckpts
    launch = run_torchrun(4, [str(REPO / "tests" / "helpers" / "dist_scripts" / "rl_weight_update.py"), old, new],
                          timeout=200)
    assert launch.returncode == 0, launch.describe()
    reports = [json.loads(line.split("REPORT ", 1)[1]) for line in launch.stdout.splitlines()
               if line.startswith("REPORT ")]
    assert sorted(r["rank"] for r in reports) == [0, 1, 2, 3], launch.describe()
    want_old, want_new = expected(old)[:2], expected(new)[:2]
    names = set(tensors(new))
    for r in reports:
        assert r["before"] == want_old and r["after"] == want_new and r["again"] == want_old, r
        # Each rank copied its own stage's layers only (2 of 4), plus the embedding on the first
        # stage or the final norm and head on the last.
        assert r["layers"] == list(range(r["start"], r["end"])) and r["end"] - r["start"] == 2
        first = r["start"] == 0
        assert r["other"] == (["model.embed_tokens.weight"] if first else ["lm_head.weight", "model.norm.weight"])
        per_layer = len([n for n in names if n.startswith("model.layers.0.")])
        assert r["loaded"] == r["reloaded"] == 2 * per_layer + len(r["other"])
    assert {(r["start"], r["end"]) for r in reports} == {(0, 2), (2, 4)}
    assert not launch.leftover_pids


@pytest.mark.timeout(120)
def test_uni_dtensor_weights_are_gathered(ckpts):
    """FSDP2 trainers hold DTensors: load_weights takes their full_tensor()."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    old, new = ckpts
    with LLM(model=str(old), max_model_len=64) as llm:  # its one-rank world hosts the mesh
        mesh = DeviceMesh("cpu", [0])
        pairs = [(n, distribute_tensor(t, mesh, [Shard(0)])) for n, t in tensors(new).items()]
        assert all(isinstance(t, DTensor) for _, t in pairs)
        assert driver_model(llm).load_weights(pairs) == set(tensors(new))
        llm.reset_prefix_cache()
        assert tokens(llm) == expected(new)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("config", [
    dict(architecture="Qwen2ForCausalLM", tie_word_embeddings=True),  # q/k/v biases, tied head
    dict(attention_bias=True, mlp_bias=True, head_dim=32),
    dict(architecture="MistralForCausalLM", num_kv_heads=1),
], ids=["qwen2-tied-bias", "llama-bias-headdim32", "mistral-mqa"])
def test_every_checkpoint_tensor_is_known_and_an_update_equals_a_fresh_load(tmp_path, config):
    """hf_tensor_shapes names every tensor of each architecture with its shape, and after
    update_weights(new) every parameter equals the one a fresh load of `new` gives."""
    from spmd_engine.kernels.packed_weights import dense_weight, pack_linear_weights
    from spmd_engine.model import load_model
    from spmd_engine.model.solo import SoloGroup
    from spmd_engine.model.weights import hf_tensor_shapes
    old = make_tiny_checkpoint(tmp_path / "old", seed=0, **config)
    new = make_tiny_checkpoint(tmp_path / "new", seed=1, **config)
    model = load_model(old, SoloGroup(), SoloGroup())
    assert pack_linear_weights(model, batch_hint=4) > 0
    new_tensors = tensors(new)
    assert {n: tuple(t.shape) for n, t in new_tensors.items()}.items() <= hf_tensor_shapes(model.spec).items()
    assert model.load_weights(new_tensors.items()) == set(new_tensors)
    fresh = dict(load_model(new, SoloGroup(), SoloGroup()).named_parameters())
    for name, param in model.named_parameters():
        value = dense_weight(param)  # the row-major weight, whichever kernel it is packed for
        # Packing gave a tied head its own copy; the fresh, unpacked model shares the embedding.
        want = fresh["model.embed_tokens.weight"] if name == "lm_head.weight" and name not in fresh else fresh[name]
        assert torch.equal(value, want), name
