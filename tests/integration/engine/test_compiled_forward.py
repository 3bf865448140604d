"""The compiled forward (issue 23; vLLM's enforce_eager=False): decoder layers through torch.compile.

The suite runs eager (tests/conftest.py sets SPMD_ENGINE_ENFORCE_EAGER=1); these tests ask for
the compiled forward explicitly, on a tiny model, most with `min_tokens=2` (one graph fewer
to build than the default, 1). Decode-shaped steps (one new token per request, all cached)
run a graph of their own, with attention traced (attention.decode_attention). One
inductor cache for the whole run (tests/helpers/inductor_cache.py): the first engine to need a
graph builds its AOTInductor package there (compilation/precompiled.py), every later one loads it. References: the same
engine eager, token for token; dynamo's counters for "never traced".
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from spmd_engine import LLM, SamplingParams
from tests.helpers.engine_helpers import make_tiny_checkpoint
from tests.helpers.inductor_cache import shared_cache_dir

COMPILED = dict(enforce_eager=False, compilation_config={"level": 3, "min_tokens": 2})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("compiled") / "tiny")


@pytest.fixture(scope="module", autouse=True)
def inductor_cache(tmp_path_factory):
    """The run's shared cache (tests/helpers/inductor_cache.py), inherited by mp workers."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(shared_cache_dir(tmp_path_factory)))
        yield


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    return [[(7 * i + 13 * j + seed) % 297 + 3 for j in range(5 + 9 * i % 23)] for i in range(n)]


def greedy(llm: LLM, batches) -> list[list[int]]:
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for batch in batches for o in llm.generate(batch, sp, use_tqdm=False)]


def runner_stats(llm: LLM) -> dict:
    return llm.get_stats()[0]["runner"]


# Batches of 1, 3, 8 and 5 requests: prefill steps of many sizes, decode steps of 1-8 tokens.
BATCHES = [prompts(1), prompts(3, 1), prompts(8, 2), prompts(5, 3)]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_compiled_greedy_equals_eager_one_graph_and_the_log_line(tiny, caplog):
    with LLM(model=str(tiny), enforce_eager=True) as llm:
        want = greedy(llm, BATCHES)
        assert runner_stats(llm)["compile_seconds"] is None
        assert runner_stats(llm)["compiled_graphs"] == 0
    with caplog.at_level(logging.INFO, logger="spmd_engine"):
        llm = LLM(model=str(tiny), **COMPILED)
    with llm:
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiled forward:")]
        assert len(lines) == 1 and " in " in lines[0] and "steps of >= 2 tokens" in lines[0], lines
        assert "through AOTInductor packages (inductor)" in lines[0] and " loaded, " in lines[0], lines
        assert greedy(llm, BATCHES) == want
        stats = runner_stats(llm)
        assert stats["compile_seconds"] > 0
        # Token counts 1..~130 over the run: two graphs (dynamic N), general steps and decode steps
        # (attention traced), no recompile (N=1 runs eager).
        assert stats["compiled_graphs"] == 2, stats


@pytest.mark.timeout(180)
def test_chunks_of_layers_share_one_graph_and_equal_eager(tiny):
    """The tiny model's 4 layers as two chunks of 2 (layers_per_graph 3 cuts 4 into 2 + 2):
    the second chunk's layers run through the first chunk's graph, with their own weights."""
    with LLM(model=str(tiny), enforce_eager=True) as llm:
        want = greedy(llm, BATCHES[1:3])
    config = {**COMPILED["compilation_config"], "layers_per_graph": 3}
    with LLM(model=str(tiny), enforce_eager=False, compilation_config=config) as llm:
        compiled = llm.llm_engine.model_executor.driver_worker.model_runner.model.compiled_layers
        assert [len(chunk) for chunk in compiled.chunks] == [2, 2]
        assert greedy(llm, BATCHES[1:3]) == want
        assert runner_stats(llm)["compiled_graphs"] == 2  # general and decode, chunk length 2


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_final_norm_runs_in_the_last_chunks_graph(tiny):
    """On the last stage each chunk's graph also returns the final RMSNorm of its result: a
    compiled step never calls the eager norm (nine ops, ~0.1 ms a decode step on CPU), the
    last chunk's norm is the model's output (two chunks here), its values are the eager norm's
    of the graph's own hidden and residual, and the tokens equal eager's."""
    import torch

    from spmd_engine.model.layers.attention import AttentionMetadata
    with LLM(model=str(tiny), enforce_eager=True) as llm:
        want = greedy(llm, BATCHES[1:3])
    config = {**COMPILED["compilation_config"], "layers_per_graph": 3}
    with LLM(model=str(tiny), enforce_eager=False, compilation_config=config) as llm:
        model = llm.llm_engine.model_executor.driver_worker.model_runner.model
        norm, calls = model.model.norm, []
        eager_norm = norm.forward
        norm.forward = lambda *a: calls.append(a[0].shape[0]) or eager_norm(*a)
        assert greedy(llm, BATCHES[1:3]) == want  # 3 and 8 requests: no step below min_tokens
        assert calls == [] and runner_stats(llm)["compiled_calls_refused"] == 0
        with torch.inference_mode():
            attn = AttentionMetadata.build([0], [3], [[0]], 16, "cpu")
            attn.slot_mapping = None  # writes nothing into the cache
            h = model.model.embed_tokens(torch.tensor([5, 6, 7]))
            hidden, residual, normed = model.compiled_layers.run(
                model.model.rotary_emb.cos_sin(attn.positions, h.dtype), h, None, attn)
            torch.testing.assert_close(normed, eager_norm(hidden, residual)[0])
        assert calls == []
        model.forward(torch.tensor([5]), torch.tensor([0]), AttentionMetadata.build([0], [1], [[0]], 16, "cpu"))
        assert calls == [1]  # one token, below min_tokens: eager layers, eager norm


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_one_token_steps_have_a_graph_of_their_own(tiny):
    """The default min_tokens (1): a single request's decode steps (one token each) run through
    a graph of their own, built at start-up with the general and the decode graph; nothing
    recompiles or falls back later."""
    with LLM(model=str(tiny), enforce_eager=True) as llm:
        want = greedy(llm, BATCHES[:2])
    with LLM(model=str(tiny), enforce_eager=False, compilation_config={"level": 3}) as llm:
        compiled = llm.llm_engine.model_executor.driver_worker.model_runner.model.compiled_layers
        full = (None,) * 4  # the chunk's four layers' windows: full attention
        assert sorted(compiled.built) == [(4, full, False, False), (4, full, False, True),
                                          (4, full, True, True)]  # at start-up
        assert greedy(llm, BATCHES[:2]) == want  # BATCHES[0] is one request: one-token steps
        stats = runner_stats(llm)
        assert (stats["compiled_graphs"], stats["compiled_calls_refused"]) == (3, 0), stats


@pytest.mark.timeout(180)
def test_without_decode_graphs_decode_steps_take_the_general_graph_as_on_cuda(tiny):
    """CUDA's rule (CompiledLayers.decode_graphs off: through dynamo there the traced cache write
    copied the whole cache every step): no graph traces attention; decode steps of 2 or more
    tokens take the general graph (the opaque attention op), one-token decodes and DecodeSteps
    themselves (the CUDA graphs' buffers) run their layers eager; the tokens equal eager's."""
    from spmd_engine.model.layers.attention import AttentionMetadata
    with LLM(model=str(tiny), enforce_eager=True) as llm:
        want = greedy(llm, BATCHES)
    with LLM(model=str(tiny), **COMPILED) as llm:
        compiled = llm.llm_engine.model_executor.driver_worker.model_runner.model.compiled_layers
        decode = AttentionMetadata.build([3, 5, 9], [1, 1, 1], [[0, 1, 2]] * 3, 16, "cpu")
        one = AttentionMetadata.build([3], [1], [[0]], 16, "cpu")
        compiled.min_tokens = 1  # for these checks only (a one-token step is below the test's 2)
        assert compiled.applies(one) and compiled.applies(decode.decode_step())  # on CPU: traced
        compiled.decode_graphs = False
        assert compiled.warm_up_steps() == [(2, False)]
        assert compiled.applies(decode) and not compiled.applies(one)
        assert not compiled.applies(decode.decode_step())
        compiled.min_tokens = 2
        program, seen = compiled.programs[0], []
        flat_inputs = program.flat_inputs
        program.flat_inputs = lambda *a: seen.append(a[4]) or flat_inputs(*a)  # a[4]: the decode tensors
        run, shapes = compiled.run, []
        compiled.run = lambda *a: shapes.append((a[3].num_tokens, a[3].decode_step() is not None)) or run(*a)
        assert greedy(llm, BATCHES) == want
        assert seen and all(d is None for d in seen)  # every graph call a general one
        assert all(n >= 2 for n, _ in shapes) and any(is_decode for _, is_decode in shapes), shapes
        assert runner_stats(llm)["compiled_calls_refused"] == 0


@pytest.mark.timeout(120)
def test_enforce_eager_and_level_0_do_not_compile(tiny):
    from torch._dynamo.utils import counters
    before = dict(counters["stats"])
    for kwargs in (dict(enforce_eager=True, compilation_config=3), dict(enforce_eager=False, compilation_config=0)):
        with LLM(model=str(tiny), **kwargs) as llm:
            assert llm.config.compilation_config.level == 0
            greedy(llm, BATCHES[:1])
            assert runner_stats(llm)["compiled_graphs"] == 0
    assert dict(counters["stats"]) == before  # dynamo never ran


_EAGER_CHILD = r"""
import sys
from spmd_engine import LLM, SamplingParams
for kwargs in ({"enforce_eager": True, "dtype": "bfloat16"}, {"dtype": "float32"}):  # fp32: eager by default
    with LLM(model=sys.argv[1], enable_sleep_mode=True, **kwargs) as llm:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)
        llm.sleep(level=1)
        llm.wake_up()  # the KV cache bound again
print(sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules))
"""


@pytest.mark.timeout(120)
def test_an_eager_engine_never_imports_dynamo(tiny):
    """Importing dynamo costs an eager start a second or more (1.7-2.1 against 3.0-3.6 s on the
    bench model, docs/performance.md): only a compiled model imports it. A fresh process, since
    this one has imported it already."""
    proc = subprocess.run([sys.executable, "-c", _EAGER_CHILD, str(tiny)], capture_output=True, text=True,
                          timeout=100, env=dict(os.environ, SPMD_ENGINE_ENFORCE_EAGER="0"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout


_DYNAMO_CHILD = r"""
import json, sys
from spmd_engine import LLM, SamplingParams
prompts = json.loads(sys.argv[2])
sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
with LLM(model=sys.argv[1], enforce_eager=False, compilation_config={"level": 3, "backend": "aot_eager"}) as llm:
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    print(json.dumps([got, llm.get_stats()[0]["runner"]["compiled_graphs"]]))
"""


@pytest.mark.timeout(180)
def test_a_backend_through_dynamo_starts_in_a_fresh_process_and_equals_eager(tiny):
    """A backend other than inductor's packages traces the layers with dynamo at start-up. In a
    fresh process the decode attention kernel has not been tried yet when its graph is traced:
    trying it inside the trace was a graph break that failed start-up (fixed by making its
    availability a constant to dynamo)."""
    import json
    with LLM(model=str(tiny), enforce_eager=True) as llm:
        want = greedy(llm, BATCHES[1:3])
    batches = [p for batch in BATCHES[1:3] for p in batch]
    proc = subprocess.run([sys.executable, "-c", _DYNAMO_CHILD, str(tiny), json.dumps(batches)], capture_output=True,
                          text=True, timeout=150, env=dict(os.environ, SPMD_ENGINE_ENFORCE_EAGER="0"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, graphs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == want and graphs >= 2, (got, graphs)


@pytest.mark.timeout(120)
def test_batch_invariant_runs_eager_and_says_so(tiny, caplog):
    with caplog.at_level(logging.INFO, logger="spmd_engine"):
        llm = LLM(model=str(tiny), batch_invariant=True, **COMPILED)
    with llm:
        assert llm.config.compilation_config.level == 0
        assert any("batch-invariant mode runs eager" in r.getMessage() for r in caplog.records)
        greedy(llm, BATCHES[:1])
        assert runner_stats(llm)["compiled_graphs"] == 0


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_mp_tp2_compiled_equals_eager(tiny):
    """Real worker processes, the all-reduce (shared memory) between them outside the graph.
    The two ranks' shards have one shape, so they need the same two packages: each is built by
    one rank at most while the other waits for it and loads it (precompiled.build_lock)."""
    tp2 = dict(model=str(tiny), tensor_parallel_size=2, distributed_executor_backend="mp", timeout_s=120)
    with LLM(**tp2, enforce_eager=True) as llm:
        want = greedy(llm, BATCHES[1:3])
    with LLM(**tp2, **COMPILED) as llm:
        assert greedy(llm, BATCHES[1:3]) == want
        stats = runner_stats(llm)
        assert stats["compiled_graphs"] == 2 and stats["compile_seconds"] > 0, stats
        loaded = llm.collective_rpc(lambda worker: len(worker.model_runner.model.compiled_layers.loaded))
        assert len(loaded) == 2 and sum(2 - n for n in loaded) <= 2, loaded  # built by one rank, not both


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_mp_pp2_compiled_equals_eager(tiny):
    """The later stage compiles from a dummy intermediate (no embedding on it)."""
    with LLM(model=str(tiny), enforce_eager=True) as llm:
        want = greedy(llm, BATCHES[2:])
    with LLM(model=str(tiny), pipeline_parallel_size=2, distributed_executor_backend="mp", timeout_s=120,
             **COMPILED) as llm:
        assert greedy(llm, BATCHES[2:]) == want
        stats = runner_stats(llm)  # the last stage's runner
        assert stats["compiled_graphs"] == 2 and stats["compile_seconds"] > 0, stats


@pytest.mark.timeout(180)
def test_weights_swapped_under_the_graph_are_read(tiny, tmp_path):
    """Sleep level 2 and load_weights (new packed Parameters, as an RL trainer's sync): the graph
    reads the new weights (its guards skip the layer modules) and does not recompile."""
    from safetensors.torch import load_file
    other = make_tiny_checkpoint(tmp_path / "other", seed=9)
    with LLM(model=str(other), enforce_eager=True) as llm:
        want = greedy(llm, BATCHES[1:3])
    with LLM(model=str(tiny), enable_sleep_mode=True, **COMPILED) as llm:
        assert greedy(llm, BATCHES[1:3]) != want
        llm.sleep(level=2)
        model = llm.llm_engine.model_executor.driver_worker.model_runner.model
        model.load_weights(load_file(str(other / "model.safetensors")).items())
        llm.wake_up()
        assert greedy(llm, BATCHES[1:3]) == want
        assert runner_stats(llm)["compiled_graphs"] == 2


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bf16_weights_packed_for_the_avx512_kernel_run_in_the_graph(tmp_path, monkeypatch):
    """A bf16 model's weights in the hand-written kernel's layout (4-D, kernels/vnni_gemm.py)
    pass through the export and the saved graph to the kernel, in packages of their own, and
    decode the tokens the oneDNN-packed graph decodes (bitwise equal matmuls at these sizes:
    tests/unit/model/test_vnni_gemm.py). Greedy steps there take their tokens from the LM head's
    fused argmax; a step with a logprobs request takes the logits and the sampler, with the same
    tokens. Skipped where the kernel is unavailable."""
    from spmd_engine.kernels import vnni_gemm
    from spmd_engine.kernels.packed_weights import layout
    if vnni_gemm.unavailable() is not None:
        pytest.skip(f"the kernel is unavailable here: {vnni_gemm.unavailable()}")
    bf16 = make_tiny_checkpoint(tmp_path / "bf16", vocab_size=320, dtype="bfloat16")  # 320: the head fits too
    fused_calls = []
    fused = vnni_gemm.linear_argmax
    monkeypatch.setattr(vnni_gemm, "linear_argmax", lambda *a: fused_calls.append(1) or fused(*a))  # uni: this process
    got = {}
    for kernel in ("onednn", "vnni"):
        monkeypatch.setenv("SPMD_ENGINE_CPU_BF16_GEMM", kernel)
        fused_calls.clear()
        with LLM(model=str(bf16), **COMPILED) as llm:
            layouts = llm.collective_rpc(lambda w: (str(w.model_runner.model.dtype), sorted(
                {layout(m.weight) for m in w.model_runner.model.modules() if getattr(m, "packable_weight", False)})))
            assert layouts == [("torch.bfloat16", [kernel])], layouts
            got[kernel] = greedy(llm, BATCHES[1:3])
            assert runner_stats(llm)["compiled_graphs"] == 2
            assert bool(fused_calls) == (kernel == "vnni"), len(fused_calls)
            if kernel == "vnni":  # one request asks for logprobs: every step of that batch samples from logits
                fused_calls.clear()
                sps = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=None if i else 0)
                       for i in range(len(BATCHES[2]))]
                outs = llm.generate(BATCHES[2], sps, use_tqdm=False)
                assert [o.outputs[0].token_ids for o in outs] == got[kernel][len(BATCHES[1]):]
                assert outs[0].outputs[0].logprobs is not None and not fused_calls
    assert got["vnni"] == got["onednn"]
