"""Phi-3 and OLMo 2 through the whole engine, against transformers' own checkpoints and forward.

The checkpoints are written by transformers (family_checkpoints.py: its config and model
classes, `save_pretrained`), tiny but with every feature on: GQA, Phi-3's fused qkv_proj /
gate_up_proj tensors, longrope with distinct short and long factors and a partial rotary,
OLMo 2's whole-projection q/k norms, post-norms and attention biases. Prompts are short
(their whole generation stays within Phi-3's original context: the short factors) and long
(past it: the long factors). Each generated token must be transformers' argmax and each
logprob its log-softmax (test_hf_reference's check). transformers scores prompt + generated
tokens in one forward, which picks the factor set as a generation that never crosses the
original context does. Prompts whose generation crosses it are held to transformers' own
`generate` (which then recomputes its cache with the long factors), step by step.

Negative controls: a reference that drops longrope (and one whose OLMo 2 norms are per rank,
at TP 2) must disagree; a shared prefix cache between a long and a short prompt must give
wrong tokens; without the recompute a crossing generation must disagree with `generate`.
"""

from __future__ import annotations

import json

import pytest
import torch
from family_checkpoints import ORIGINAL_CONTEXT, olmo2_config, phi3_config, save_random
from test_hf_reference import MAX_TOKENS, disagreements, hf_logprobs, hf_model

from spmd_engine import LLM, SamplingParams
from spmd_engine.config import ConfigError
from spmd_engine.model.spec import ModelSpec

FAMILIES = {"phi3": phi3_config, "olmo2": olmo2_config}
LENGTHS = (3, 9, ORIGINAL_CONTEXT + 2, 2 * ORIGINAL_CONTEXT - 5)  # short ones end within the original context
assert LENGTHS[1] + MAX_TOKENS <= ORIGINAL_CONTEXT


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dense_families")
    return {name: save_random(config(), root / name, seed=i) for i, (name, config) in enumerate(FAMILIES.items())}


def prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 131, (n,), generator=gen).tolist() for n in LENGTHS]


def generate(path, prompt_list, **engine) -> list[tuple[list[int], list[dict]]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3, ignore_eos=True)
    with LLM(model=str(path), enforce_eager=True, **engine) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompt_list], params)
        stats = llm.get_stats()
    generate.stats = stats
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


def problems_against(hf, prompt_list, outputs) -> list[str]:
    problems = []
    for prompt, (tokens, logprobs) in zip(prompt_list, outputs, strict=True):
        problems += disagreements(prompt, tokens, logprobs, hf_logprobs(hf, prompt, tokens))
    return problems


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", FAMILIES)
def test_uni_matches_transformers(checkpoints, name):
    outputs = generate(checkpoints[name], prompts())
    problems = problems_against(hf_model(checkpoints[name]), prompts(), outputs)
    assert not problems, "\n".join(problems[:10])


@pytest.mark.timeout(180)
def test_reference_without_longrope_disagrees(checkpoints, tmp_path):
    """Negative control: the long prompts' tokens are not those of the short factors, nor of
    plain RoPE, so the check above sees the long factors."""
    from transformers import AutoModelForCausalLM
    path = checkpoints["phi3"]
    outputs = generate(path, prompts())
    hf = hf_model(path)
    config = hf.config
    long_only = {**config.rope_parameters, "short_factor": config.rope_parameters["long_factor"]}
    short_only = {**config.rope_parameters, "long_factor": config.rope_parameters["short_factor"]}
    for rope, which in ((short_only, slice(2, 4)), (long_only, slice(0, 2))):
        wrong = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                     rope_parameters=rope).eval()
        for prompt, out in zip(prompts()[which], outputs[which]):
            assert problems_against(wrong, [prompt], [out]), (prompt, rope)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", FAMILIES)
def test_chunked_prefill_prefix_cache_and_preemption_match_transformers(checkpoints, name):
    """Prompts cut into 8-token chunks, repeated (prefix-cache hits), in a cache too small to
    hold them all (preemption and recompute); a short prompt shares a long one's first blocks,
    which under longrope were turned by other factors and must not be reused."""
    base = prompts(1)
    long_prompt = base[3]
    prompt_list = [long_prompt, long_prompt[:8] + base[0], long_prompt, base[2], long_prompt[:8] + base[1][:4]]
    per_token = 2 * 2 * 16 * 4 * 4  # K and V, 2 KV heads of 16, 4 layers, float32
    engine = dict(enable_chunked_prefill=True, max_num_batched_tokens=8, enable_prefix_caching=True, block_size=8,
                  kv_cache_memory_bytes=per_token * 8 * 8, max_model_len=64, max_num_seqs=3)
    outputs = generate(checkpoints[name], prompt_list, **engine)
    stats = generate.stats
    assert sum(s["preemptions"] for s in stats) > 0 and sum(s["prefix_hits_tokens"] for s in stats) > 0
    problems = problems_against(hf_model(checkpoints[name]), prompt_list, outputs)
    assert not problems, "\n".join(problems[:10])


@pytest.mark.timeout(240)
def test_longrope_prompts_do_not_share_prefix_blocks_across_factor_sets(checkpoints, monkeypatch):
    """Negative control for the prefix-cache root: with every prompt chained from one root, the
    short prompt reuses the long prompt's long-factor blocks and its tokens go wrong."""
    from spmd_engine.model.layers import longrope
    monkeypatch.setattr(longrope, "prefix_cache_root", lambda root, scaling, n: root)
    base = prompts(1)
    prompt_list = [base[3], base[3][:8] + base[1][:4]]
    outputs = generate(checkpoints["phi3"], prompt_list, enable_prefix_caching=True, block_size=8,
                       max_num_seqs=1)
    assert sum(s["prefix_hits_tokens"] for s in generate.stats) == 8
    assert problems_against(hf_model(checkpoints["phi3"]), prompt_list[1:], outputs[1:])


@pytest.mark.timeout(60)
def test_config_errors_name_the_field(checkpoints):
    phi3 = json.loads((checkpoints["phi3"] / "config.json").read_text())
    bad = json.loads(json.dumps(phi3))
    bad["rope_parameters"]["short_factor"] = bad["rope_parameters"]["short_factor"][:-1]
    with pytest.raises(ConfigError, match="short_factor"):
        ModelSpec.from_hf_config(bad)
    llama = {**phi3, "architectures": ["LlamaForCausalLM"]}
    llama["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        ModelSpec.from_hf_config(llama)
    spec = ModelSpec.from_hf_config(phi3)
    assert spec.fused_checkpoint and spec.rotary_dim == 8 and spec.rope_scaling["attention_factor"] > 1


CROSSING = (ORIGINAL_CONTEXT - 4, ORIGINAL_CONTEXT)  # prompts whose generation grows past the original context


def crossing_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, 131, (n,), generator=gen).tolist() for n in CROSSING]


@torch.inference_mode()
def generate_problems(hf, prompt_list, outputs) -> list[str]:
    """Where our tokens or logprobs differ from transformers' greedy `generate` (its raw logits)."""
    problems = []
    for prompt, (tokens, logprobs) in zip(prompt_list, outputs, strict=True):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                          do_sample=False, output_logits=True, return_dict_in_generate=True)
        ref = torch.log_softmax(torch.stack([step[0] for step in out.logits]).float(), dim=-1)
        problems += disagreements(prompt, tokens, logprobs, ref)
    return problems


@pytest.mark.timeout(240)
def test_generation_crossing_the_original_context_matches_transformers_generate(checkpoints):
    """Alone, and cut into chunks with prefix-cache hits and preemption around the recompute."""
    hf = hf_model(checkpoints["phi3"])
    prompt_list = crossing_prompts()
    per_token = 2 * 2 * 16 * 4 * 4
    for engine in ({}, dict(enable_chunked_prefill=True, max_num_batched_tokens=8, block_size=8,
                            kv_cache_memory_bytes=per_token * 8 * 8, max_model_len=64, max_num_seqs=3)):
        repeated = prompt_list + prompt_list[:1] if engine else prompt_list
        outputs = generate(checkpoints["phi3"], repeated, **engine)
        assert sum(s["preemptions"] for s in generate.stats) >= len(repeated)  # each recomputed once at least
        problems = generate_problems(hf, repeated, outputs)
        assert not problems, (engine, "\n".join(problems[:10]))


@pytest.mark.timeout(240)
def test_without_the_recompute_a_crossing_generation_disagrees(checkpoints, monkeypatch):
    from spmd_engine.model.layers import longrope
    monkeypatch.setattr(longrope.LongRopeSwitch, "__call__", lambda self, request: False)
    prompt_list = crossing_prompts()
    outputs = generate(checkpoints["phi3"], prompt_list)
    hf = hf_model(checkpoints["phi3"])
    for prompt, out in zip(prompt_list, outputs):
        assert generate_problems(hf, [prompt], [out])
