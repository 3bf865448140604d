"""Sliding-window models through the whole engine against transformers 5 (issue 53).

Two random checkpoints made by transformers' own config and model classes (save_pretrained):
a Mistral whose every layer has a small sliding window, and a Qwen2 mixing full-attention and
windowed layers (use_sliding_window + max_window_layers). Prompts and generations run well past
the window; the engine generates greedily with logprobs, prefilling whole, in chunks (a small
max_num_batched_tokens), from the prefix cache (a second round of the same prompts), under
preemption (a tiny KV budget) and in batch-invariant mode, and transformers' eager forward
scores the same sequences (test_hf_reference.disagreements: argmax and logprobs, fp32).
"""

from __future__ import annotations

import pytest
import torch
from conftest import require_reference
from test_hf_reference import TOP_K, disagreements, hf_logprobs

from spmd_engine import LLM, SamplingParams

MAX_TOKENS = 12  # as test_hf_reference.disagreements expects
BLOCK = 4
SMALL = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, max_position_embeddings=256)
MODELS = {
    "mistral-window6": ("MistralForCausalLM", dict(num_hidden_layers=2, sliding_window=6)),
    "qwen2-full-then-window5": ("Qwen2ForCausalLM", dict(num_hidden_layers=3, use_sliding_window=True,
                                                         sliding_window=5, max_window_layers=1)),
}


def _save(path, arch: str, extra: dict, seed: int):
    transformers = require_reference("transformers")
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**SMALL, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).float()
    with torch.no_grad():  # random weights large enough that the window changes the logits
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("swa")
    return {name: _save(root / name, arch, extra, i) for i, (name, (arch, extra)) in enumerate(MODELS.items())}


def _hf(path):
    transformers = require_reference("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def _prompts(n=(3, 13, 29, 22)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, SMALL["vocab_size"], (k,), generator=gen).tolist() for k in n]


def _run(path, prompts, rounds=1, sleep=False, **settings):
    """The last of `rounds` generations of `prompts` (sleeping and waking between them if `sleep`)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP_K, ignore_eos=True)
    with LLM(model=str(path), block_size=BLOCK, max_model_len=64, **settings) as llm:
        for i in range(rounds):
            if sleep and i:
                llm.sleep(1)
                llm.wake_up()
            outs = llm.generate(prompts, params)
        stats = llm.get_stats()[0]
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], stats


def _problems(hf, prompts, outputs) -> list[str]:
    problems = []
    for prompt, (tokens, logprobs) in zip(prompts, outputs, strict=True):
        problems += disagreements(prompt, tokens, logprobs, hf_logprobs(hf, prompt, tokens))
    return problems


def _kv_bytes(path, blocks: int) -> int:
    import json
    cfg = json.loads((path / "config.json").read_text())
    return blocks * BLOCK * 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 4


SETTINGS = {
    "whole": dict(),
    "chunked": dict(max_num_batched_tokens=8, enable_prefix_caching=False),
    "prefix-cache": dict(rounds=2),
    "preempted": dict(kv_blocks=16, max_num_batched_tokens=16),
    "batch-invariant": dict(batch_invariant=True, max_num_batched_tokens=8),
    "slept-and-woken": dict(rounds=2, sleep=True, enable_sleep_mode=True, max_num_batched_tokens=8),
    "async-chunked-preempted": dict(async_scheduling=True, max_num_batched_tokens=8, kv_blocks=16),
    "mp-tp2pp2-chunked-preempted": dict(tensor_parallel_size=2, pipeline_parallel_size=2, max_num_batched_tokens=8,
                                        kv_blocks=16),
}


QUICK = {("mistral-window6", "prefix-cache"), ("qwen2-full-then-window5", "chunked")}
CASES = [pytest.param(name, setting, id=f"{name}-{setting}",
                      marks=() if (name, setting) in QUICK else pytest.mark.slow)
         for name in MODELS for setting in SETTINGS]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name,setting", CASES)
def test_engine_matches_transformers_past_the_window(checkpoints, name, setting):
    settings = dict(SETTINGS[setting])
    path = checkpoints[name]
    if "kv_blocks" in settings:
        settings["kv_cache_memory_bytes"] = _kv_bytes(path, settings.pop("kv_blocks"))
    prompts = _prompts()
    outputs, stats = _run(path, prompts, **settings)
    assert not (problems := _problems(_hf(path), prompts, outputs)), "\n".join(problems[:10])
    if setting == "prefix-cache":
        assert stats["prefix_hits_tokens"] > 0
    if setting == "preempted" and name.startswith("qwen2"):  # keeps every block: preempted
        assert stats["preemptions"] > 0


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_the_window_matters_to_the_reference(checkpoints, tmp_path):
    """Negative control: the same engine outputs scored by transformers with the window off
    disagree (the prompts are long enough for the window to change the logits)."""
    import json
    import shutil
    name = "mistral-window6"
    prompts = _prompts()
    outputs, _ = _run(checkpoints[name], prompts)
    unwindowed = shutil.copytree(checkpoints[name], tmp_path / "full")
    cfg = json.loads((unwindowed / "config.json").read_text())
    cfg["sliding_window"] = None
    (unwindowed / "config.json").write_text(json.dumps(cfg))
    assert _problems(_hf(unwindowed), prompts[2:3], outputs[2:3])


@pytest.mark.timeout(240)
def test_freeing_out_of_window_blocks_avoids_preemption(checkpoints, monkeypatch):
    """Four 41-token Mistral requests in 16 blocks of 4: each holds the blocks of its window, so
    all run at once and none is preempted; without the freeing (negative control) they are."""
    path = checkpoints["mistral-window6"]
    prompts = _prompts()
    tight = dict(kv_cache_memory_bytes=_kv_bytes(path, 16), max_num_batched_tokens=64)
    outputs, stats = _run(path, prompts, **tight)
    assert stats["preemptions"] == 0 and stats["peak_running"] == 4
    assert not _problems(_hf(path), prompts, outputs)
    from spmd_engine.model import windows
    monkeypatch.setattr(windows, "kv_freeing_window", lambda *args: None)
    _, kept = _run(path, prompts, **tight)
    assert kept["preemptions"] > 0


@pytest.mark.timeout(240)
def test_a_sliding_only_model_serves_sequences_longer_than_its_cache(checkpoints):
    """8 blocks of 4 (32 tokens) serve 41-token Mistral sequences of max_model_len 64, a chunk of
    8 at a time: each holds its window and chunk only. The mixed model, whose full layers keep
    every block, is refused the same budget (one-line ConfigError, before any process starts)."""
    from spmd_engine.config import ConfigError
    path = checkpoints["mistral-window6"]
    prompts = _prompts()
    outputs, stats = _run(path, prompts, kv_cache_memory_bytes=_kv_bytes(path, 8), max_num_batched_tokens=8)
    assert stats["num_blocks"] == 8
    assert not _problems(_hf(path), prompts, outputs)
    mixed = checkpoints["qwen2-full-then-window5"]
    with pytest.raises(ConfigError, match="fewer than max_model_len 64"):
        _run(mixed, prompts, kv_cache_memory_bytes=_kv_bytes(mixed, 8), max_num_batched_tokens=8)
