"""A KV cache of several groups end to end (issue 53): models mixing full and sliding-window layers
(the tiny Qwen2 with max_window_layers of test_sliding_window.py, the tiny Gemma 3 of
test_gemma3.py) through LLM, greedy tokens and logprobs against transformers (those files'
reference helpers), slow (engine start-ups; the quick suite runs both models on the grouped cache
through test_sliding_window.py and test_gemma3.py). The Qwen2 model's sliding group frees what falls out of its window,
so a budget its full group fits runs without preemption; with the freeing off (negative
control) the same budget preempts. Gemma 3 with chunked prefill, prefix-cache hits and
preemption in one run. The multi-rank layouts (mp TP2 x PP2) are test_gemma3.py's and
test_sliding_window.py's, which run these models on the grouped cache too."""

from __future__ import annotations

import json

import pytest
from gemma_checkpoint import make_gemma3_checkpoint
from test_sliding_window import BLOCK, MODELS, _hf, _problems, _prompts, _run, _save

from spmd_engine.config import SchedulerConfig
from spmd_engine.core import kv_groups
from spmd_engine.core.kv_cache_manager import KVCacheManager


def _group_budget(path, full_blocks: int, max_num_seqs: int, max_num_batched_tokens: int, tp: int = 1,
                  layers: slice = slice(None)) -> int:
    """kv_cache_memory_bytes for `full_blocks` blocks of the full group, each group sized as the
    workers size it (fp32), on a rank of `tp` holding `layers`."""
    cfg = json.loads((path / "config.json").read_text())
    from spmd_engine.model.spec import ModelSpec
    windows = ModelSpec.from_hf_config(cfg, str(path)).layer_windows[layers]
    per_layer = 2 * cfg["num_key_value_heads"] // tp * cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]) * 4
    shares = {w: per_layer * windows.count(w) for w in set(windows)}
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens).resolve(64, BLOCK)
    return kv_groups.bytes_held(full_blocks, BLOCK, shares, sc)


@pytest.fixture(scope="module")
def qwen2_mixed(tmp_path_factory):
    arch, extra = MODELS["qwen2-full-then-window5"]
    return _save(tmp_path_factory.mktemp("kvgroups") / "qwen2", arch, extra, 1)


TIGHT = dict(max_num_seqs=4, max_num_batched_tokens=8)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_sliding_group_frees_its_window_so_a_tight_budget_runs(qwen2_mixed, monkeypatch):
    path = qwen2_mixed
    prompts = _prompts()
    budget = _group_budget(path, 32, **TIGHT)
    outputs, stats = _run(path, prompts, kv_cache_memory_bytes=budget, **TIGHT)
    assert stats["num_blocks"] == 32 and stats["preemptions"] == 0 and stats["peak_running"] == 4
    assert not (problems := _problems(_hf(path), prompts, outputs)), "\n".join(problems[:10])
    monkeypatch.setattr(KVCacheManager, "_free_out_of_window", lambda self, table, num_computed: None)
    _, kept = _run(path, prompts, kv_cache_memory_bytes=budget, **TIGHT)
    assert kept["preemptions"] > 0


LAYOUTS = {"uni": dict(), "mp-tp2pp2": dict(tensor_parallel_size=2, pipeline_parallel_size=2)}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gemma3_chunked_prefix_hits_and_preemption_match_transformers(tmp_path, layout):
    """On mp TP2 x PP2 the first stage (a sliding and the full layer, half the KV heads) sets
    the count; the second, sliding layers only, sizes its pools from it."""
    from gemma_checkpoint import WINDOW
    path = make_gemma3_checkpoint(tmp_path / "gemma3")
    prompts = _prompts((3, 13, 29, 22, 29))
    prompts[4] = prompts[2][:24] + prompts[4][:5]  # a hit past the window, then its own tokens
    assert min(len(p) for p in prompts[1:]) > WINDOW
    settings = dict(max_num_seqs=4, max_num_batched_tokens=8)
    shape = dict(tp=2, layers=slice(0, 2)) if layout != "uni" else {}
    budget = _group_budget(path, 24, **settings, **shape)
    outputs, stats = _run(path, prompts, rounds=2, kv_cache_memory_bytes=budget, **settings, **LAYOUTS[layout])
    assert stats["num_blocks"] == 24
    assert stats["preemptions"] > 0 and stats["prefix_hits_tokens"] > 0
    assert not (problems := _problems(_hf(path), prompts, outputs)), "\n".join(problems[:10])
