"""compilation_config and enforce_eager (vLLM's forms) through the one config path (issue 23)."""

from __future__ import annotations

import logging

import pytest
import torch

from spmd_engine import envs
from spmd_engine.config import CompilationConfig, ConfigError, ModelConfig
from spmd_engine.engine.arg_utils import EngineArgs, resolve_compilation
from spmd_engine.model.spec import ModelSpec
from spmd_engine.run.main import build_parser

DENSE = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}
MOE = {**DENSE, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2}


@pytest.mark.parametrize("value, level", [(None, None), (0, 0), (3, 3), ("2", 2), ({"level": 1}, 1),
                                          ({"mode": 3}, 3), ('{"mode": 0}', 0), ({"level": 3, "mode": 3}, 3)])
def test_vllm_forms_parse(value, level):
    assert CompilationConfig.parse(value).level == level


def test_ours_and_vllms_ignored_keys():
    cc = CompilationConfig.parse({"level": 3, "min_tokens": 4, "cudagraph_capture_sizes": [8, 1, 2, 2],
                                  "backend": "aot_eager", "cache_dir": "/tmp/x", "layers_per_graph": 3,
                                  "cudagraph_num_of_warmups": 2, "cudagraph_mode": "full_decode_only"})
    assert (cc.min_tokens, cc.backend, cc.cache_dir, cc.layers_per_graph, cc.ignored) == (
        4, "aot_eager", "/tmp/x", 3, ("cudagraph_num_of_warmups",))
    assert (cc.cudagraph_capture_sizes, cc.cudagraph_mode) == ((1, 2, 8), "FULL_DECODE_ONLY")
    assert (CompilationConfig().min_tokens, CompilationConfig().layers_per_graph) == (1, 8)
    assert CompilationConfig.parse({"use_cudagraph": False}).cudagraph_mode == "NONE"  # vLLM's older switch
    assert CompilationConfig.parse({"cudagraph_mode": "CUDAGraphMode.PIECEWISE"}).cudagraph_mode == "PIECEWISE"


@pytest.mark.parametrize("layers, per_graph, lengths", [
    (8, 8, [8]), (8, 1, [1] * 8), (2, 8, [2]), (9, 8, [5, 4]), (28, 8, [7, 7, 7, 7]),
    (22, 8, [8, 7, 7]), (80, 8, [8] * 10), (1, 3, [1]), (0, 8, [])])
def test_layers_are_cut_into_chunks_of_at_most_two_lengths(layers, per_graph, lengths):
    """Each chunk length is one graph: any depth compiles one or two, never one per remainder."""
    from spmd_engine.compilation.compiled_layers import chunks
    cut = chunks(list(range(layers)), per_graph)
    assert [len(c) for c in cut] == lengths
    assert [x for c in cut for x in c] == list(range(layers))  # every layer once, in order


@pytest.mark.parametrize("value, match", [(5, "0, 1, 2 or 3"), (True, "a level"), ("x3", "neither"),
                                          ({"levle": 3}, "unknown key"), ({"level": 1, "mode": 3}, "gives"),
                                          ({"backend": "tvm"}, "backend"), ({"min_tokens": 0}, "min_tokens"),
                                          ({"layers_per_graph": 0}, "layers_per_graph"),
                                          ([3], "a level"), ({"cudagraph_mode": "ALL"}, "cudagraph_mode"),
                                          ({"cudagraph_capture_sizes": [0, 8]}, "positive integers"),
                                          ({"cudagraph_capture_sizes": "8"}, "positive integers"),
                                          ({"cudagraph_capture_sizes": []}, "positive integers")])
def test_bad_values_are_config_errors(value, match):
    with pytest.raises(ConfigError, match=match):
        CompilationConfig.parse(value)


def resolve(enforce_eager=None, cc=None, hf=DENSE, device="cpu", batch_invariant=False, dtype=torch.bfloat16):
    return resolve_compilation(enforce_eager, cc, ModelConfig(batch_invariant=batch_invariant),
                               ModelSpec.from_hf_config(hf), device, dtype).level


def test_resolution_rules(monkeypatch, caplog):
    monkeypatch.setenv(envs.ENFORCE_EAGER, "0")
    assert resolve() == 3  # the default on CPU in bf16: compiled
    assert resolve(dtype=torch.float16) == 3
    assert resolve(dtype=torch.float32) == 0 and resolve(dtype=torch.float32, cc=3) == 3  # fp32: on request
    assert resolve(cc=1) == 1
    assert resolve(enforce_eager=True, cc=3) == 0  # enforce_eager wins
    assert resolve(device="cuda") == 0 and resolve(device="cuda", cc=3) == 3  # CUDA: on request only
    with caplog.at_level(logging.INFO, logger="spmd_engine"):
        assert resolve(batch_invariant=True) == 0
        assert resolve(hf=MOE) == 0
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "batch-invariant mode runs eager" in said and "MoE layers" in said
    monkeypatch.setenv(envs.ENFORCE_EAGER, "1")  # the suite's switch: the default becomes eager
    assert resolve() == 0 and resolve(enforce_eager=False) == 3
    monkeypatch.setenv(envs.ENFORCE_EAGER, "yes")
    with pytest.raises(ConfigError, match=envs.ENFORCE_EAGER):
        resolve()


def test_cli_flags_reach_the_engine_args():
    parser = build_parser()
    args = parser.parse_args(["--prompt", "x", "--enforce-eager", "-O", '{"level": 3, "min_tokens": 8}'])
    ea = EngineArgs.from_cli_args(args)
    assert ea.enforce_eager is True and CompilationConfig.parse(ea.compilation_config).min_tokens == 8
    ea = EngineArgs.from_cli_args(parser.parse_args(["--prompt", "x", "--compilation-config", "0"]))
    assert ea.enforce_eager is None and CompilationConfig.parse(ea.compilation_config).level == 0


def test_cuda_graph_resolution_follows_vllm(monkeypatch, caplog):
    """CUDA graphs (decode steps) on CUDA unless enforce_eager or cudagraph_mode NONE, whatever the
    level; never on CPU (an explicit mode there says so in a log line); off in batch-invariant mode
    and for MoE models."""
    monkeypatch.setenv(envs.ENFORCE_EAGER, "0")

    def mode(enforce_eager=None, cc=None, hf=DENSE, device="cuda", batch_invariant=False):
        return resolve_compilation(enforce_eager, cc, ModelConfig(batch_invariant=batch_invariant),
                                   ModelSpec.from_hf_config(hf), device, torch.bfloat16).cudagraph_mode

    assert mode() == "FULL_DECODE_ONLY" and mode(cc=3) == "FULL_DECODE_ONLY"
    assert mode(cc={"cudagraph_mode": "FULL_AND_PIECEWISE"}) == "FULL_AND_PIECEWISE"
    assert mode(enforce_eager=True) == "NONE" and mode(cc={"cudagraph_mode": "NONE"}) == "NONE"
    assert mode(cc={"use_cudagraph": False}) == "NONE"
    with caplog.at_level(logging.INFO, logger="spmd_engine"):
        assert mode(device="cpu") == "NONE" and mode(device="cpu", cc={"cudagraph_mode": "FULL"}) == "NONE"
        assert mode(batch_invariant=True) == "NONE" and mode(hf=MOE) == "NONE"
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "captured on CUDA only" in said and "CUDA graphs: off (batch-invariant mode)" in said
    assert "CUDA graphs: off (MixtralForCausalLM has MoE layers)" in said
