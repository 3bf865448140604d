"""The rest of vLLM's LLM surface trainers call (issue 13): prompt forms, use_tqdm, vLLM's
other keyword arguments, EOS ids from generation_config.json, the max_model_len default,
fresh versus seeded randomness, and LLM under srun."""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import pytest
from engine_helpers import make_tiny_checkpoint

from spmd_engine import LLM, SamplingParams
from spmd_engine.config import ConfigError

IDS = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=4)


def token_ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.timeout(120)
def test_every_prompt_form_of_vllm():
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    with LLM(max_model_len=128) as llm:  # the bundled model: byte tokens, BOS 256
        ids = [256] + list(b"Errors should")
        (ref,) = llm.generate([ids], greedy)
        assert ref.outputs[0].text == " never"
        forms = ["Errors should", ["Errors should"], {"prompt": "Errors should"}, [{"prompt": "Errors should"}],
                 {"prompt_token_ids": ids}, [{"prompt_token_ids": ids}], ids, [ids]]
        for form in forms:
            (out,) = llm.generate(form, greedy)
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids, form
            assert out.prompt_token_ids == ids
        mixed = llm.generate(["Errors should", {"prompt_token_ids": ids}, {"prompt": "Beautiful is"}, ids], greedy)
        assert [o.outputs[0].text for o in mixed] == [" never"] * 2 + [" bette", " never"]
        assert [o.prompt for o in mixed] == ["Errors should", None, "Beautiful is", None]
        for bad, message in [({"prompt": "x", "multi_modal_data": 1}, r"unsupported key\(s\) \['multi_modal_data'\]"),
                             ({"text": "x"}, "unsupported key"), ({}, "needs 'prompt'"),
                             ({"prompt_token_ids": "abc"}, "prompt_token_ids must be a list of token ids")]:
            with pytest.raises(ConfigError, match=message):
                llm.generate([bad], greedy)
        assert llm.generate("Errors should", greedy)[0].outputs[0].text == " never"  # still working


@pytest.mark.timeout(120)
def test_use_tqdm_drives_the_given_bar(ckpt):
    bars = []

    class Bar:  # vLLM's use_tqdm may be a tqdm class: it is called with total= and updated
        def __init__(self, total, **kwargs):
            self.total, self.n, self.closed = total, 0, False
            bars.append(self)

        def update(self, k):
            self.n += k

        def close(self):
            self.closed = True

    with LLM(model=str(ckpt), max_model_len=64) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=3, n=2)
        llm.generate([IDS, [9, 10]], params, use_tqdm=Bar)
        assert [(b.total, b.n, b.closed) for b in bars] == [(4, 4, True)]
        llm.generate([IDS], params, use_tqdm=False)
        llm.generate([IDS], params, use_tqdm=True)  # tqdm's own bar when installed; nothing otherwise
        assert len(bars) == 1


@pytest.mark.timeout(120)
def test_vllm_only_arguments_warn_once_and_typos_fail(ckpt, caplog):
    with caplog.at_level(logging.WARNING, logger="spmd_engine"):
        with LLM(model=str(ckpt), max_model_len=64, enforce_eager=True, disable_log_stats=True,
                 model_impl="vllm", max_num_seqs=8, gpu_memory_utilization=0.5) as llm:
            assert llm.config.scheduler_config.max_num_seqs == 8  # known ones are honoured
            assert llm.config.cache_config.gpu_memory_utilization == 0.5
            assert len(llm.generate([IDS], SamplingParams(temperature=0.0, max_tokens=2))[0].outputs[0].token_ids) == 2
    warned = [r.getMessage() for r in caplog.records if "no effect here" in r.getMessage()]
    assert len(warned) == 1, warned
    assert all(name in warned[0] for name in ("disable_log_stats", "model_impl"))
    assert all(name not in warned[0] for name in ("max_num_seqs", "gpu_memory_utilization", "enforce_eager"))
    with pytest.raises(TypeError, match="unexpected keyword argument 'enforce_eagr'"):
        LLM(model=str(ckpt), enforce_eagr=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_num_seq'"):
        LLM(model=str(ckpt), max_num_seq=8, enforce_eager=True)


@pytest.mark.timeout(120)
def test_every_eos_id_of_generation_config_stops(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "tiny", seed=6)
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(model=str(ckpt), max_model_len=64) as llm:
        ids = llm.generate([IDS], free)[0].outputs[0].token_ids
    assert 2 not in ids  # config.json's EOS (2) never comes: the run goes to max_tokens
    stop_at = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    # Llama-3-Instruct's shape: a list, here with a token the model writes at position stop_at.
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, ids[stop_at]]}))
    with LLM(model=str(ckpt), max_model_len=64) as llm:
        out = llm.generate([IDS], SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0]
        assert out.token_ids == ids[:stop_at + 1] and out.finish_reason == "stop"
        assert out.stop_reason == ids[stop_at]  # vLLM: the extra EOS ids act as stop token ids
        assert llm.generate([IDS], free)[0].outputs[0].token_ids == ids  # ignore_eos still works
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": ids[stop_at]}))  # an int
    with LLM(model=str(ckpt), max_model_len=64) as llm:
        assert llm.generate([IDS], SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0].token_ids == ids[:stop_at + 1]


@pytest.mark.timeout(120)
def test_max_model_len_defaults_to_the_models_positions(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "long", max_position_embeddings=16384)
    per_token = 4 * 2 * 2 * 8 * 4  # layers x (K, V) x KV heads x head_dim x fp32 bytes
    budget = 8192 * per_token  # 8192 tokens: one max_model_len sequence does not fit
    with pytest.raises(ConfigError, match=r"fewer than max_model_len 16384 .*lower --max-model-len"):
        LLM(model=str(ckpt), kv_cache_memory_bytes=budget)
    with LLM(model=str(ckpt), kv_cache_memory_bytes=2 * budget) as llm:
        assert llm.max_model_len == 16384 and llm.config.scheduler_config.max_model_len == 16384
    with LLM(model=str(ckpt), kv_cache_memory_bytes=budget, max_model_len=8192) as llm:
        assert llm.generate([IDS], SamplingParams(temperature=0.0, max_tokens=2))[0].outputs[0].token_ids


TEMP1 = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
PROMPTS = [IDS, [9, 10, 11], IDS]


def two_calls(llm, params=TEMP1):
    return token_ids(llm.generate(PROMPTS, params)), token_ids(llm.generate(PROMPTS, params))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", [dict(), dict(data_parallel_size=2)],
                         ids=["uni", "mp-dp2"])
def test_unseeded_requests_draw_fresh_randomness_every_call(ckpt, layout):
    with LLM(model=str(ckpt), max_model_len=64, seed=1, **layout) as llm:
        first, second = two_calls(llm)
        seeded = two_calls(llm, SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True, seed=42))
    assert first != second  # vLLM: no request seed, fresh randomness on every generate
    assert first[0] != first[2]  # the same prompt twice in one call: two draws
    assert seeded[0] == seeded[1] and seeded[0][0] == seeded[0][2]  # a request seed fixes it
    # The engine seed starts the stream (drawn in the front end, whatever the layout or the
    # replica a prompt lands on): a new uni engine with it draws the same.
    with LLM(model=str(ckpt), max_model_len=64, seed=1) as llm:
        assert two_calls(llm) == (first, second)
    with LLM(model=str(ckpt), max_model_len=64, seed=2) as llm:
        assert two_calls(llm)[0] != first


@pytest.mark.timeout(60)
def test_engine_seed_none_is_vllms_0_and_must_be_an_integer(ckpt):
    with LLM(model=str(ckpt), max_model_len=64, seed=None) as llm:
        assert llm.seed == 0
    with pytest.raises(ConfigError, match="seed must be an integer"):
        LLM(model=str(ckpt), seed="1")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_llm_under_srun_is_external_launcher_with_fresh_randomness_agreed_by_ranks(tmp_path, ckpt):
    """Stand-in srun, 2 tasks, no torchrun variables: LLM resolves to external_launcher (as the
    CLI does), both TP ranks draw the same unseeded samples, and the two calls differ. No
    engine seed is seed 0 (vLLM), and three engines start one after another in the tasks."""
    import fake_slurm
    from launch import PYTHON, REPO, Launch, base_env

    bin_dir = fake_slurm.install(tmp_path / "bin")
    script = str(REPO / "tests" / "helpers" / "dist_scripts" / "llm_under_srun.py")
    for attempt in range(3):
        tag = f"llm-srun-{attempt}-{os.getpid()}"
        env = base_env(tag, fake_slurm.batch_env(bin_dir, nodes=1, ntasks=2))
        launch = Launch([[str(bin_dir / "srun"), "-n", "2", PYTHON, script, str(ckpt)]], [env], tag, timeout=200)
        if not launch.port_in_use():
            break
    assert not launch.timed_out and launch.returncode == 0, launch.describe()
    results = [json.loads(line) for line in launch.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 2 and results[0] == results[1], launch.describe()
    (result,) = results[:1]
    assert result["backend"] == "external_launcher"
    assert result["without_seed"] == result["seed_0"]
    assert "ranks [0, 1] have engine seeds [5, 6]" in result["seed_mismatch"]
    assert result["first"] != result["second"]
    assert not launch.leftover_pids


@pytest.mark.timeout(60)
def test_none_means_vllms_default_as_trainers_pass_it(ckpt, caplog):
    """TRL passes None for what its user left unset (max_num_seqs, max_model_len, quantization):
    vLLM takes None as the default, and so do we; a real quantization method is refused by name."""
    with LLM(model=str(ckpt)) as llm:
        want = llm.config
    with caplog.at_level(logging.WARNING, logger="spmd_engine"):
        with LLM(model=str(ckpt), max_num_seqs=None, max_model_len=None, max_num_batched_tokens=None,
                 gpu_memory_utilization=None, block_size=None, swap_space=None, quantization=None, seed=None,
                 model_impl="auto") as llm:
            assert llm.config.scheduler_config == want.scheduler_config
            same = dataclasses.replace(llm.config.cache_config, num_gpu_blocks=want.cache_config.num_gpu_blocks)
            assert same == want.cache_config and llm.seed == 0  # (the block count follows free memory)
    assert not [r for r in caplog.records if "no effect here" in r.getMessage()]  # None and defaults: silent
    with pytest.raises(ConfigError, match="quantization='awq' is not supported"):
        LLM(model=str(ckpt), quantization="awq")


@pytest.mark.timeout(120)
def test_llm_auto_runs_a_bf16_checkpoint_in_bf16_where_native(tmp_path, monkeypatch):
    """The engine's side of tests/unit/model/test_dtype.py: the model a worker builds."""
    import torch
    monkeypatch.setenv("SPMD_ENGINE_CPU_BF16", "1")
    bf16_ckpt = make_tiny_checkpoint(tmp_path, dtype="bfloat16")
    with LLM(model=str(bf16_ckpt), max_model_len=64, distributed_executor_backend="uni") as llm:
        model = llm.llm_engine.model_executor.driver_worker.model_runner.model
        assert model.dtype == torch.bfloat16
        out = llm.generate([{"prompt_token_ids": [1, 5, 9]}], SamplingParams(max_tokens=4, temperature=0.0))
        assert len(out[0].outputs[0].token_ids) == 4
