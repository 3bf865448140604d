"""Compiled chunks saved to disk as AOTInductor packages and loaded by the next process
(compilation/precompiled.py, issue 23).

A warm start loads the package instead of compiling; that is only sound if the loaded graph
is the one these inputs need, so each test here ends with the tokens of an eager engine. The
cross-process test is the one that matters: it is what a warm start does, and it shows that
loading imports no compiler (the second of start-up the packages exist for).
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys

import pytest
import torch

from spmd_engine import LLM, SamplingParams
from spmd_engine.compilation import precompiled
from tests.helpers.engine_helpers import make_tiny_checkpoint
from tests.helpers.inductor_cache import shared_cache_dir

CONFIG = {"level": 3, "min_tokens": 2}
PROMPTS = [[(7 * i + 13 * j) % 297 + 3 for j in range(5 + 9 * i)] for i in range(3)]

_CHILD = r"""
import json, sys
from spmd_engine import LLM, SamplingParams
with LLM(model=sys.argv[1], enforce_eager=False, compilation_config={"level": 3, "min_tokens": 2},
         kv_cache_memory_bytes=int(sys.argv[3])) as llm:
    outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    stats = llm.get_stats()[0]["runner"]
blocks = llm.config.cache_config.num_gpu_blocks
compilers = sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules)
sys.stdout.write(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "stats": stats,
                             "num_blocks": blocks, "compilers": compilers}) + "\n")
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("precompiled") / "tiny")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty inductor cache of the test's own (mp workers and children inherit it)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    return tmp_path / "inductor"


def greedy(llm: LLM) -> list[list[int]]:
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


def eager_tokens(tiny) -> list[list[int]]:
    with LLM(model=str(tiny), enforce_eager=True) as llm:
        return greedy(llm)


def saved(cache) -> list:
    return sorted((cache / precompiled.FOLDER).glob("*" + precompiled.SUFFIX))


def child(tiny, env_cache, kv_bytes: int) -> dict:
    import os
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(env_cache))
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(tiny), json.dumps(PROMPTS), str(kv_bytes)], env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_fresh_process_loads_the_saved_graph_and_equals_eager(tiny, cache):
    want = eager_tokens(tiny)
    first = child(tiny, cache, kv_bytes=4 << 20)
    # Two graphs (min_tokens 2): general steps, and decode steps with their attention traced.
    assert first["stats"]["compiled_graphs_loaded"] == 0 and len(saved(cache)) == 2
    # Another KV cache size: the saved graphs take any number of blocks (the caches' first dim
    # is marked dynamic when the layers compile, compilation.mark_caches_dynamic).
    second = child(tiny, cache, kv_bytes=2 << 20)
    assert second["num_blocks"] < first["num_blocks"], (first["num_blocks"], second["num_blocks"])
    assert second["stats"]["compiled_graphs_loaded"] == 2, second["stats"]
    assert second["stats"]["compiled_calls_refused"] == 0, second["stats"]  # the graph ran every step
    # Loading a package imports no compiler: the second of start-up a warm start saves.
    assert first["compilers"] == ["torch._dynamo", "torch._inductor"] and second["compilers"] == []
    assert first["tokens"] == second["tokens"] == want


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_unreadable_saved_graph_is_compiled_again_and_replaced(tiny, cache, caplog, tmp_path_factory,
                                                                  monkeypatch):
    want = eager_tokens(tiny)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(shared_cache_dir(tmp_path_factory)))  # seeds ours
    with LLM(model=str(tiny), enforce_eager=False, compilation_config=CONFIG) as llm:
        assert greedy(llm) == want
        compiled = llm.llm_engine.model_executor.driver_worker.model_runner.model.compiled_layers
        built = [package.path for package in compiled.built.values()]
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    (cache / precompiled.FOLDER).mkdir(parents=True)
    for package in built:
        shutil.copy(package, cache / precompiled.FOLDER / package.name)
    path = saved(cache)[0]
    path.write_bytes(b"not a compiled function")
    with caplog.at_level(logging.WARNING, logger="spmd_engine"):
        llm = LLM(model=str(tiny), enforce_eager=False, compilation_config=CONFIG)
    with llm:
        assert any("cannot load" in r.getMessage() for r in caplog.records)
        stats = llm.get_stats()[0]["runner"]
        assert (stats["compiled_graphs_loaded"], stats["compiled_graphs"]) == (1, 2)
        assert greedy(llm) == want
    assert path.read_bytes() != b"not a compiled function"
    with LLM(model=str(tiny), enforce_eager=False, compilation_config=CONFIG) as llm:
        assert llm.get_stats()[0]["runner"]["compiled_graphs_loaded"] == 2  # the replacement loads
        assert greedy(llm) == want


def _model(tiny, dtype=torch.float32):
    from spmd_engine.model.loader import load_model
    from spmd_engine.model.solo import SoloGroup
    model = load_model(tiny, SoloGroup(), SoloGroup(), dtype=dtype)
    model.allocate_kv_cache(8, 16)
    return model


@pytest.mark.slow
@pytest.mark.timeout(240)
@torch.inference_mode()
def test_inputs_the_package_refuses_run_eager(tiny, tmp_path_factory, monkeypatch):
    """A hidden state with other strides than the graph was built for (a view of every other
    column), through the compiled layers directly: refused by the package's input checks, it runs eager, with
    eager's bits, and is counted."""
    from spmd_engine.model.layers.attention import AttentionMetadata
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(shared_cache_dir(tmp_path_factory)))
    model = _model(tiny)
    model.compile_layers(min_tokens=2)
    compiled = model.compiled_layers
    attn = AttentionMetadata.build([0], [3], [[0]], 16, "cpu")
    model.forward(torch.tensor([5, 6, 7]), attn.positions, attn)  # builds the graph (N = 3)
    assert compiled.refused == 0 and compiled.graphs() == 1
    attn = AttentionMetadata.build([3], [2], [[0]], 16, "cpu")
    dense = model.model.embed_tokens(torch.tensor([8, 9]))
    h = torch.zeros(2, 2 * dense.shape[1], dtype=dense.dtype)[:, ::2]
    h.copy_(dense)
    rope = model.model.rotary_emb.cos_sin(attn.positions, h.dtype)
    got = compiled.run(rope, h, None, attn)
    assert compiled.refused == 1 and compiled.graphs() == 1
    assert got[2] is None  # the chunk ran eager: the caller norms eager
    model.compiled_layers = None
    hidden, residual = dense, None
    for layer in model.model.layers.values():
        hidden, residual = layer(rope, hidden, residual, attn)
    assert torch.equal(got[0], hidden) and torch.equal(got[1], residual)


def test_the_file_name_changes_with_what_decides_the_graph(tiny):
    fp32, bf16 = _model(tiny), _model(tiny, torch.bfloat16)
    key = precompiled.digest(fp32, 4, "inductor", None)
    assert key == precompiled.digest(_model(tiny), 4, "inductor", None)  # the same facts, the same file
    others = {precompiled.digest(bf16, 4, "inductor", None), precompiled.digest(fp32, 2, "inductor", None),
              precompiled.digest(fp32, 4, "inductor", "max-autotune"),
              precompiled.digest(fp32, 4, "inductor", None, single=True),
              precompiled.digest(fp32, 4, "inductor", None, decode=True)}
    other_shape = _model(make_tiny_checkpoint(tiny.parent / "wider", hidden_size=128))
    others.add(precompiled.digest(other_shape, 4, "inductor", None))
    no_final_norm = _model(tiny)  # a pipeline stage before the last: its graphs end without the norm
    no_final_norm.model.norm = None
    others.add(precompiled.digest(no_final_norm, 4, "inductor", None))
    assert key not in others and len(others) == 7
