"""The whole engine against an independent reference: Hugging Face transformers.

For every architecture we load (Llama, Mistral, Qwen2), a random tiny checkpoint whose
config hits an edge case (GQA ratios from MHA to MQA, odd vocab sizes, tied embeddings,
biases, head_dim != hidden / heads, llama3 and linear RoPE scaling) generates greedily
through `LLM.generate` with logprobs, `ignore_eos` so nothing ends early. transformers then
scores the same sequences (teacher forcing, one forward pass per sequence) and must agree:
each generated token is its argmax (unless its top two are a near tie) and every returned
logprob matches its log-softmax. Negative controls show the check catches a wrong RoPE
scaling and a wrong token.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import require_reference
from make_random_checkpoint import make_random_checkpoint  # noqa: E402

from spmd_engine import LLM, SamplingParams

MAX_TOKENS = 12
TOP_K = 3
LOGPROB_ATOL = 2e-4
TIE_MARGIN = 1e-3  # top-two logits closer than this: either token is a correct greedy choice

CONFIGS = {
    # GQA 4:1, odd (prime) vocab, llama3 RoPE with a short original context so all bands are used
    "llama-gqa4-llama3rope-vocab251": dict(
        architecture="LlamaForCausalLM", hidden_size=64, num_layers=3, num_heads=8, num_kv_heads=2,
        intermediate_size=96, vocab_size=251, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16}),
    # MHA, head_dim 16 != 48 / 4, q/k/v/o and MLP biases, linear RoPE, tied embeddings, vocab 97
    "llama-mha-headdim16-bias-linearrope-tied": dict(
        architecture="LlamaForCausalLM", hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=4,
        head_dim=16, intermediate_size=64, vocab_size=97, attention_bias=True, mlp_bias=True,
        tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    # MQA (one KV head), head_dim 32 != 64 / 8
    "mistral-mqa-headdim32": dict(
        architecture="MistralForCausalLM", hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=1,
        head_dim=32, intermediate_size=128, vocab_size=130),
    # q/k/v biases (always on in Qwen2), tied embeddings, GQA 2:1, vocab 153
    "qwen2-tied-bias": dict(
        architecture="Qwen2ForCausalLM", hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
        intermediate_size=128, vocab_size=153, tie_word_embeddings=True),
}

# One uni run per config, plus the parallel layouts where the edge case meets sharding.
CASES = [(name, {}) for name in CONFIGS] + [
    ("llama-gqa4-llama3rope-vocab251", dict(tensor_parallel_size=2, pipeline_parallel_size=2)),
    ("mistral-mqa-headdim32", dict(tensor_parallel_size=2)),  # the single KV head replicated on both ranks
    ("qwen2-tied-bias", dict(pipeline_parallel_size=2)),  # tied head on the last stage only
]


def copy_with_config(src: Path, dst: Path, **changes) -> Path:
    """A copy of checkpoint `src` whose config.json has `changes` applied (negative controls)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def prompts_for(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(vocab)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (1, 5, 9, 17)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_ref")
    return {name: make_random_checkpoint(root / name, seed=i, **cfg) for i, (name, cfg) in enumerate(CONFIGS.items())}


def hf_model(path: Path):
    transformers = require_reference("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@torch.inference_mode()
def hf_logprobs(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """log-softmax over the vocab at each generated position, [len(generated), vocab]."""
    ids = torch.tensor([prompt + generated])
    logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) + len(generated) - 1].float()
    return torch.log_softmax(logits, dim=-1)


def disagreements(prompt, tokens, logprobs, ref: torch.Tensor) -> list[str]:
    """Where our greedy tokens and logprobs differ from the reference's; empty when they agree."""
    problems = []
    if len(tokens) != MAX_TOKENS or len(logprobs) != MAX_TOKENS:
        problems.append(f"{len(tokens)} tokens / {len(logprobs)} logprob maps, expected {MAX_TOKENS}")
    for step, (token, ours) in enumerate(zip(tokens, logprobs)):
        top2 = ref[step].topk(2)
        margin = float(top2.values[0] - top2.values[1])
        if token != int(top2.indices[0]) and margin > TIE_MARGIN:
            problems.append(f"prompt {prompt} step {step}: token {token}, reference argmax {int(top2.indices[0])} "
                            f"(margin {margin:.3g})")
        if token not in ours or len(ours) < TOP_K:
            problems.append(f"step {step}: logprobs {ours} lack the sampled token {token} or the top {TOP_K}")
        for tid, entry in ours.items():
            value = entry.logprob
            if abs(value - float(ref[step, tid])) > LOGPROB_ATOL:
                problems.append(f"step {step} token {tid}: logprob {value:.6f}, reference {float(ref[step, tid]):.6f}")
        ref_top = set(ref[step].topk(TOP_K).indices.tolist())
        if margin > TIE_MARGIN and len(ours) >= TOP_K and not ref_top <= set(ours):
            problems.append(f"step {step}: top-{TOP_K} ids {sorted(ours)} vs reference {sorted(ref_top)}")
    return problems


def engine_outputs(path: Path, prompts, **layout):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP_K, ignore_eos=True)
    with LLM(model=str(path), **layout) as llm:
        outs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name, layout", CASES,
                         ids=[n + ("" if not l else "-" + ",".join(f"{k.split('_')[0]}{v}" for k, v in l.items()))
                              for n, l in CASES])
def test_engine_matches_transformers(checkpoints, name, layout):
    path = checkpoints[name]
    hf = hf_model(path)
    prompts = prompts_for(CONFIGS[name]["vocab_size"])
    problems = []
    for prompt, (tokens, logprobs) in zip(prompts, engine_outputs(path, prompts, **layout), strict=True):
        problems += disagreements(prompt, tokens, logprobs, hf_logprobs(hf, prompt, tokens))
    assert not problems, "\n".join(problems[:10])


@pytest.mark.timeout(120)
def test_hf_reads_the_edge_cases_we_configured(checkpoints):
    """The reference really runs with the edge cases (not defaults it fell back to)."""
    mha = hf_model(checkpoints["llama-mha-headdim16-bias-linearrope-tied"])
    attn = mha.model.layers[0].self_attn
    assert attn.q_proj.out_features == 4 * 16 and attn.o_proj.bias is not None
    assert mha.model.layers[0].mlp.gate_proj.bias is not None
    assert mha.lm_head.weight.data_ptr() == mha.model.embed_tokens.weight.data_ptr()
    mistral = hf_model(checkpoints["mistral-mqa-headdim32"])
    assert mistral.model.layers[0].self_attn.k_proj.out_features == 32
    qwen = hf_model(checkpoints["qwen2-tied-bias"])
    assert qwen.model.layers[0].self_attn.q_proj.bias is not None


@pytest.mark.timeout(120)
def test_negative_controls_wrong_rope_and_wrong_token_are_caught(checkpoints, tmp_path):
    """The comparison is able to fail: the llama3-scaled model against a reference that drops
    the scaling, and a correct output with one token changed."""
    name = "llama-gqa4-llama3rope-vocab251"
    prompts = prompts_for(CONFIGS[name]["vocab_size"])[2:]  # 9 and 17 tokens: past original_max 16
    outputs = engine_outputs(checkpoints[name], prompts)
    unscaled = copy_with_config(checkpoints[name], tmp_path / "unscaled", rope_scaling=None)
    wrong_hf, right_hf = hf_model(unscaled), hf_model(checkpoints[name])
    for prompt, (tokens, logprobs) in zip(prompts, outputs, strict=True):
        assert not disagreements(prompt, tokens, logprobs, hf_logprobs(right_hf, prompt, tokens))
        assert disagreements(prompt, tokens, logprobs, hf_logprobs(wrong_hf, prompt, tokens))
    prompt, (tokens, logprobs) = prompts[0], outputs[0]
    broken = list(tokens)
    broken[4] = (broken[4] + 1) % CONFIGS[name]["vocab_size"]
    assert any("reference argmax" in p for p in disagreements(prompt, broken, logprobs,
                                                              hf_logprobs(right_hf, prompt, tokens)))
    assert disagreements(prompt, tokens[:-1], logprobs[:-1], hf_logprobs(right_hf, prompt, tokens[:-1]))
