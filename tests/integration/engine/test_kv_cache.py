"""The paged KV cache through the whole engine: every cache setting gives the tokens of a
no-cache reference decode, prefix hits skip work, preemption changes nothing.

Prompts are token ids on a tiny random checkpoint; `ignore_eos` keeps every request
running to max_tokens, so a request that stops early cannot hide a wrong token.
"""

from __future__ import annotations

import json
import re

import pytest
from engine_helpers import make_tiny_checkpoint, reference_greedy
from launch import run_torchrun

from spmd_engine import LLM, SamplingParams
from spmd_engine.config import ConfigError

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11], [12, 13, 14, 15], [16, 17, 18]]
MAX_TOKENS = 14  # prompts + outputs cross a 16-token block boundary
MAX_MODEL_LEN = 32
# The tiny model holds 512 bytes of K/V per token at TP=1 (4 layers x 2 heads x 8 dims x fp32 x K,V):
# 3 blocks of 16 tokens cannot hold six 19-token requests at once, so some are preempted.
TIGHT_KV_BYTES_TP1 = 3 * 16 * 512


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def expected(ckpt):
    return [reference_greedy(ckpt, p, MAX_TOKENS) for p in PROMPTS]


def generate(ckpt, prompts=PROMPTS, **kwargs):
    with LLM(model=str(ckpt), max_model_len=MAX_MODEL_LEN, **kwargs) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
        stats = llm.get_stats()
    return [o.outputs[0].token_ids for o in outs], stats


@pytest.mark.timeout(120)
@pytest.mark.parametrize("settings", [
    dict(),
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=16),
    dict(max_num_batched_tokens=64, block_size=32),
    dict(block_size=32, enable_prefix_caching=False),
    dict(enable_chunked_prefill=False),
    dict(kv_cache_memory_bytes=TIGHT_KV_BYTES_TP1),
    dict(kv_cache_memory_bytes=TIGHT_KV_BYTES_TP1, max_num_batched_tokens=16, enable_prefix_caching=False),
], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "defaults")
def test_uni_every_cache_setting_matches_reference(ckpt, expected, settings):
    tokens, stats = generate(ckpt, **settings)
    assert tokens == expected
    if "kv_cache_memory_bytes" in settings:
        assert stats[0]["num_blocks"] == 3
        assert stats[0]["preemptions"] > 0  # the budget really forced preemption
    if settings.get("max_num_batched_tokens") == 16:
        assert stats[0]["steps"] > MAX_TOKENS  # the 6 prompts (18 tokens) did not fit one step


@pytest.mark.timeout(240)
@pytest.mark.parametrize("settings", [
    dict(max_num_batched_tokens=16, kv_cache_memory_bytes=3 * 16 * 128),
    dict(block_size=32, max_num_batched_tokens=64, enable_prefix_caching=False,
         kv_cache_memory_bytes=2 * 32 * 128),
], ids=["chunk16,preempt", "block32,chunk64,no-prefix-cache,2-blocks"])
@pytest.mark.slow
def test_mp_tp2_pp2_cache_settings_match_reference(ckpt, expected, settings):
    # TP=2 x PP=2: 128 bytes per token per rank (2 layers x 1 KV head x 8 dims x fp32 x K,V).
    tokens, stats = generate(ckpt, tensor_parallel_size=2, pipeline_parallel_size=2, **settings)
    assert tokens == expected
    if settings["block_size" if "block_size" in settings else "max_num_batched_tokens"] == 16:
        assert stats[0]["preemptions"] > 0  # 3 blocks of 16 for six requests growing past one block
    else:
        assert stats[0]["peak_running"] == 2  # one 32-token block each: two at a time, the rest wait


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_tp2_pp2_dp2_chunked_and_preempted_matches_reference(ckpt, expected, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "out.jsonl"
    launch = run_torchrun(8, ["-m", "spmd_engine.run", "--model", ckpt, "-tp", 2, "-pp", 2, "-dp", 2,
                              "--prompts-file", prompts, "--max-tokens", MAX_TOKENS, "--max-model-len",
                              MAX_MODEL_LEN, "--max-num-batched-tokens", 16,
                              "--kv-cache-memory-bytes", 2 * 16 * 128, "--output", out], timeout=280)
    assert launch.returncode == 0, launch.describe()
    records = [json.loads(line) for line in out.read_text().splitlines()]
    # The CLI stops at the checkpoint's EOS (id 2), as the reference does when told to.
    reference = [reference_greedy(ckpt, p, MAX_TOKENS, eos=2) for p in PROMPTS]
    assert [r["token_ids"] for r in records] == reference
    assert sum(r["finish_reason"] == "length" for r in records) >= 3  # most ran the whole way
    # Each replica's head logs its engine counters: 3 requests of up to 19 tokens in 2 blocks.
    preemptions = [int(n) for n in re.findall(r"engine stats \(replica \d\): steps=\d+ preemptions=(\d+)",
                                              launch.stderr)]
    assert len(preemptions) == 2 and sum(preemptions) > 0, launch.stderr
    assert not launch.leftover_pids


@pytest.mark.timeout(120)
def test_prefix_hits_compute_only_the_uncached_tail(ckpt):
    prompt = list(range(1, 41))  # 40 tokens: 2 full blocks of 16 can be reused, 8 tokens cannot
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    with LLM(model=str(ckpt), max_model_len=64) as llm:
        def prefill_tokens():
            return llm.get_stats()[0]["runner"]["prefill_tokens"]
        first = llm.generate([prompt], params)
        assert prefill_tokens() == 40
        again = llm.generate([prompt], params)
        assert prefill_tokens() == 40 + 8  # the second time only the tail after 32 cached tokens
        assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
        # Four copies in one call: the first computes all 40, the others the tail only.
        llm.reset_prefix_cache()
        copies = llm.generate([prompt] * 4, params)
        assert prefill_tokens() == 48 + 40 + 3 * 8
        assert all(c.outputs[0].token_ids == first[0].outputs[0].token_ids for c in copies)
        stats = llm.get_stats()[0]
        assert stats["prefix_hits_tokens"] == 32 + 3 * 32


@pytest.mark.timeout(120)
def test_reset_prefix_cache_drops_every_cached_block(ckpt):
    prompt = list(range(1, 41))
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    with LLM(model=str(ckpt), max_model_len=64) as llm:
        llm.generate([prompt], params)
        assert llm.get_stats()[0]["cached_blocks"] > 0
        assert llm.reset_prefix_cache() is True
        assert llm.get_stats()[0]["cached_blocks"] == 0
        before = llm.get_stats()[0]["runner"]["prefill_tokens"]
        llm.generate([prompt], params)
        assert llm.get_stats()[0]["runner"]["prefill_tokens"] - before == 40  # nothing was reused


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_prefix_stats_and_reset_reach_mp_and_dp_replicas(ckpt):
    prompt = list(range(1, 41))
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    with LLM(model=str(ckpt), max_model_len=64, tensor_parallel_size=2) as llm:
        llm.generate([prompt, prompt], params)
        assert llm.get_stats()[0]["runner"]["prefill_tokens"] == 40 + 8
    with LLM(model=str(ckpt), max_model_len=64, data_parallel_size=2) as llm:
        llm.generate([prompt, prompt], params)  # one prompt per replica: no sharing across replicas
        stats = llm.get_stats()
        assert [s["runner"]["prefill_tokens"] for s in stats] == [40, 40]
        assert llm.reset_prefix_cache() is True
        assert [s["cached_blocks"] for s in llm.get_stats()] == [0, 0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kwargs, needle", [
    (dict(block_size=0), "block_size must be a power of two >= 1, got 0"),
    (dict(block_size=24), "block_size must be a power of two >= 1, got 24"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization must be in (0, 1], got 1.5"),
    (dict(max_num_batched_tokens=8), "max_num_batched_tokens (8) must be >= block_size (16)"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be an integer >= 1, got 0"),
    (dict(kv_cache_memory_bytes=16 * 256), "holds 1 blocks of 16 tokens = 16 tokens, fewer than max_model_len 32"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=16), "smaller than max_model_len (32)"),
])
def test_bad_cache_settings_are_config_errors_before_any_process(ckpt, kwargs, needle):
    with pytest.raises(ConfigError) as info:
        LLM(model=str(ckpt), max_model_len=MAX_MODEL_LEN, tensor_parallel_size=2, **kwargs)
    assert needle in str(info.value)


@pytest.mark.timeout(120)
def test_plan_prints_the_kv_budget_for_a_model(ckpt):
    import subprocess
    import sys
    cmd = [sys.executable, "-m", "spmd_engine.plan", "-tp", "2", "--model", str(ckpt), "--max-model-len", "32"]
    out = subprocess.run([*cmd, "--kv-cache-memory-bytes", str(4 * 16 * 256)], capture_output=True, text=True,
                         timeout=100)
    assert out.returncode == 0, out.stderr
    # TP=2: 1 KV head per rank x 4 layers x 8 dims x fp32 x K,V = 256 bytes per token.
    assert ("KV cache: 256 bytes per token per rank; budget 0.000 GiB per rank (--kv-cache-memory-bytes) "
            "= 4 blocks of 16 tokens = 64 tokens = 2 sequences of max_model_len 32") in out.stdout
    out = subprocess.run([*cmd, "--kv-cache-memory-bytes", "4096", "--json"], capture_output=True, text=True,
                         timeout=100)
    kv = json.loads(out.stdout)["kv_cache"]
    assert (kv["num_blocks"], kv["bytes_per_token"]) == (1, 256) and "too small" in kv["line"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags, needle", [
    (["--block-size", "0"], "error: --block-size: block_size must be a power of two >= 1, got 0"),
    (["--gpu-memory-utilization", "1.5"], "error: --gpu-memory-utilization: gpu_memory_utilization must be in (0, 1]"),
    (["--max-num-batched-tokens", "8"], "error: --max-num-batched-tokens: max_num_batched_tokens (8) must be >= "
                                        "block_size (16)"),
    (["--kv-cache-memory-bytes", "1000"], "error: KV cache budget 1000 bytes per rank holds 0 blocks"),
])
def test_cli_bad_cache_flags_exit_2_with_one_line(flags, needle, tmp_path):
    import subprocess
    import sys
    out = tmp_path / "out.jsonl"
    proc = subprocess.run([sys.executable, "-m", "spmd_engine.run", "-tp", "2", "--prompt", "Beautiful is",
                           "--output", str(out), *flags], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(needle), proc.stderr
    assert not out.exists()
