"""ModelRegistry.register_model (vLLM's): a trainer's own class for an architecture name is the
class every rank builds, under uni, mp (spawned workers, which never ran the registration) and
torchrun (every rank registers it). The class here negates the logits, so greedy decoding picks
each step's least likely token: outputs that only that class can produce."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from engine_helpers import make_tiny_checkpoint, reference_greedy
from torch import nn

from spmd_engine import LLM, ModelRegistry, SamplingParams
from spmd_engine.config import ConfigError
from spmd_engine.model.models.llama import CausalLM

PROMPTS = [list(range(1, 40)), [4, 5, 6, 7, 8]]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ARCH = "NegatedLlamaForCausalLM"


class NegatedLogitsLlama(CausalLM):
    def compute_logits(self, hidden):
        return -super().compute_logits(hidden)


class RenamedLlama(CausalLM):
    """Only a new name: must generate what the built-in class does."""


def worker_model_class(worker) -> str:
    return type(worker.model_runner.model).__name__


@pytest.fixture
def registry():
    """The registry is process-wide: each test's registrations are undone after it."""
    models, user = dict(ModelRegistry.models), set(ModelRegistry._user)
    yield ModelRegistry
    ModelRegistry.models.clear()
    ModelRegistry.models.update(models)
    ModelRegistry._user.clear()
    ModelRegistry._user.update(user)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("base"), seed=0)


def renamed(base, where, arch: str):
    """A copy of the checkpoint whose config.json names `arch`."""
    out = shutil.copytree(base, where)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "architectures": [arch]}))
    return out


@torch.inference_mode()
def least_likely_greedy(model_dir, prompt: list[int], max_tokens: int) -> list[int]:
    """The built-in model, no cache, picking the argmin: what NegatedLogitsLlama must give."""
    from spmd_engine.model import load_model
    from spmd_engine.model.solo import SoloGroup
    model = load_model(model_dir, SoloGroup(), SoloGroup())
    assert type(model) is CausalLM
    ids = list(prompt)
    for _ in range(max_tokens):
        hidden = model.forward(torch.tensor([ids]), torch.arange(len(ids))[None, :], None, None)["hidden_states"]
        ids.append(int(model.compute_logits(hidden[0, -1:]).argmin(-1)))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def expected(base):
    return [least_likely_greedy(base, p, MAX_TOKENS) for p in PROMPTS]


def tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.timeout(120)
def test_uni_builds_the_registered_class(registry, base, expected, tmp_path):
    registry.register_model(ARCH, NegatedLogitsLlama)
    assert ARCH in registry.get_supported_archs() and registry.is_text_generation_model([ARCH])
    with LLM(model=str(renamed(base, tmp_path / "neg", ARCH)), max_model_len=64) as llm:
        assert llm.collective_rpc(worker_model_class) == ["NegatedLogitsLlama"]
        got = tokens(llm)
    assert got == expected
    assert got != [reference_greedy(base, p, MAX_TOKENS) for p in PROMPTS]


@pytest.mark.timeout(120)
def test_a_module_class_string_is_imported_when_built_and_a_renamed_class_changes_nothing(registry, base,
                                                                                          tmp_path):
    registry.register_model("RenamedLlamaForCausalLM", f"{__name__}:RenamedLlama")
    assert registry.models["RenamedLlamaForCausalLM"] == f"{__name__}:RenamedLlama"  # not imported yet
    with LLM(model=str(renamed(base, tmp_path / "ren", "RenamedLlamaForCausalLM")), max_model_len=64) as llm:
        assert llm.collective_rpc(worker_model_class) == ["RenamedLlama"]
        assert tokens(llm) == [reference_greedy(base, p, MAX_TOKENS) for p in PROMPTS]


@pytest.mark.timeout(180)
def test_mp_tp2_workers_build_the_class_registered_in_the_engine_process(registry, base, expected, tmp_path):
    registry.register_model(ARCH, NegatedLogitsLlama)
    with LLM(model=str(renamed(base, tmp_path / "neg", ARCH)), max_model_len=64, tensor_parallel_size=2,
             distributed_executor_backend="mp") as llm:
        assert llm.collective_rpc(worker_model_class) == ["NegatedLogitsLlama"] * 2
        assert tokens(llm) == expected


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torchrun_tp2_every_rank_registers_and_builds_the_class(base, expected, tmp_path):
    from launch import REPO, run_torchrun
    model_dir = renamed(base, tmp_path / "neg", ARCH)
    launch = run_torchrun(2, [str(REPO / "tests" / "helpers" / "dist_scripts" / "model_registry.py"), model_dir,
                              ARCH], timeout=200)
    assert launch.returncode == 0, launch.describe()
    reports = [json.loads(line.split("REPORT ", 1)[1]) for line in launch.stdout.splitlines()
               if line.startswith("REPORT ")]
    assert sorted(r["rank"] for r in reports) == [0, 1], launch.describe()
    for r in reports:
        assert r["class"] == "NegatedLogitsLlama" and r["tokens"] == expected, r
    assert not launch.leftover_pids


@pytest.mark.timeout(60)
def test_a_class_without_the_model_interface_is_refused_in_one_line(registry, base, tmp_path):
    class Bare(nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(ConfigError, match=r"Bare \(registered for 'BareForCausalLM'\) lacks __init__\(hf_config, "
                                          r"tp_group, pp_group, dtype=.*compute_logits, greedy_tokens") as info:
        registry.register_model("BareForCausalLM", Bare)
    assert "\n" not in str(info.value) and "subclass spmd_engine.model.models.llama.CausalLM" in str(info.value)
    assert "BareForCausalLM" not in registry.get_supported_archs()
    with pytest.raises(TypeError, match="must be a torch.nn.Module class or a 'module:Class' string"):
        registry.register_model("X", 42)
    with pytest.raises(ValueError, match="format `<module>:<class>`"):
        registry.register_model("X", "no_colon_here")
    with pytest.raises(TypeError, match="`model_arch` should be a string"):
        registry.register_model(None, NegatedLogitsLlama)
    # A "module:Class" is checked when first built: at LLM(...), before any worker starts.
    registry.register_model("GoneForCausalLM", "no_such_module_here:Model")
    with pytest.raises(ConfigError, match="cannot import 'no_such_module_here:Model' registered for 'GoneForCausalLM'"):
        LLM(model=str(renamed(base, tmp_path / "gone", "GoneForCausalLM")), max_model_len=64)
    # A built-in's name too, refused in this process, not as an mp worker's failed start.
    registry.register_model("MistralForCausalLM", "no_such_module_here:Model")
    with pytest.raises(ConfigError, match="cannot import 'no_such_module_here:Model' registered for 'Mistral"):
        LLM(model=str(renamed(base, tmp_path / "mistral", "MistralForCausalLM")), max_model_len=64,
            tensor_parallel_size=2, distributed_executor_backend="mp")
    with pytest.raises(ConfigError, match=r"unsupported architecture NopeForCausalLM .*GoneForCausalLM"):
        LLM(model=str(renamed(base, tmp_path / "nope", "NopeForCausalLM")), max_model_len=64)


@pytest.mark.timeout(60)
def test_a_class_spawned_workers_cannot_import_is_refused_before_they_start(registry, base, tmp_path):
    class Local(CausalLM):
        pass

    registry.register_model("LocalForCausalLM", Local)
    with pytest.raises(ConfigError, match="Local.*cannot reach the worker processes.*module level"):
        LLM(model=str(renamed(base, tmp_path / "local", "LocalForCausalLM")), max_model_len=64,
            tensor_parallel_size=2, distributed_executor_backend="mp")


def test_a_new_architecture_reads_config_json_as_its_class_says(registry):
    from spmd_engine.model.spec import ModelSpec

    class Qwen2Like(CausalLM):
        hf_config_architecture = "Qwen2ForCausalLM"

    registry.register_model("MyQwen2ForCausalLM", Qwen2Like)
    registry.register_model("MyLlamaForCausalLM", RenamedLlama)
    config = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  vocab_size=100, use_sliding_window=False, sliding_window=32)
    qwen = ModelSpec.from_hf_config({**config, "architectures": ["MyQwen2ForCausalLM"]})
    llama = ModelSpec.from_hf_config({**config, "architectures": ["MyLlamaForCausalLM"]})
    assert (qwen.architecture, qwen.qkv_bias, qwen.sliding_window) == ("MyQwen2ForCausalLM", True, None)
    assert (llama.qkv_bias, llama.sliding_window) == (False, 32)  # LlamaForCausalLM's reading
    # vLLM tries each name of `architectures` in turn.
    assert ModelSpec.from_hf_config({**config, "architectures": ["Unknown", "MyQwen2ForCausalLM"]}).qkv_bias

