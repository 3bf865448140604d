"""logprobs_mode, the sampling mask and the logit processors, against transformers (issue 26).

The reference is independent of the engine's sampler: transformers' logits of the same
checkpoint, teacher-forced on the engine's own tokens, with vLLM's processing applied here
by hand (allowed_token_ids, bad_words, min_tokens, logit_bias, penalties, then temperature,
min_p, top_k, top_p). Two float computations of the same logits differ by ~1e-6, so a
token whose keep-or-drop decision lies within EPS of a threshold is ambiguous: such
positions are counted (and must be rare), everything else must agree exactly (the mask)
or within TOL (the values).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from engine_helpers import make_tiny_checkpoint

from spmd_engine import LLM, SamplingParams
from spmd_engine.config import ConfigError

EPS = 1e-4  # a decision closer than this to its threshold may go either way
TOL = 2e-4  # logprob / logit agreement between two float computations
PROMPTS = [[5, 17, 99, 3, 42, 8, 61], [200, 1, 2, 3], [7] * 9, [11, 12, 13, 14, 15, 16], [250, 40]]


def params_set():
    common = dict(max_tokens=16, logprobs=5, return_sampling_mask=True, ignore_eos=True)
    return [
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.3,
                       presence_penalty=0.5, frequency_penalty=0.3, logit_bias={5: 3.0, 9: -2.0},
                       bad_words=["ab", "c"], seed=1, **common),
        SamplingParams(temperature=0.0, allowed_token_ids=list(range(100, 130)), **common),
        SamplingParams(temperature=1.0, top_p=0.5, seed=2, **common),
        SamplingParams(temperature=1.3, top_k=5, min_tokens=3, stop_token_ids=[7], seed=3,
                       frequency_penalty=-0.5, **common),
        SamplingParams(temperature=0.9, min_p=0.15, seed=5, **common),
    ]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("modes"), seed=21)
    config = json.loads((path / "config.json").read_text())
    config["spmd_engine_tokenizer"] = "bytes"  # bad_words need a tokenizer: bytes are tokens
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def hf(ckpt):
    from conftest import require_reference
    transformers = require_reference("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()


@torch.inference_mode()
def hf_rows(hf, prompt, tokens) -> torch.Tensor:
    """Raw logits at the positions that produced each generated token, [T, V]."""
    ids = torch.tensor([prompt + tokens])
    return hf(ids).logits[0, len(prompt) - 1: len(prompt) + len(tokens) - 1].float()


def processed_row(raw: torch.Tensor, p: SamplingParams, prompt, history, eos_ids):
    """vLLM's processing of one row by hand: (processed logits x, kept set, ambiguous)."""
    x = raw.clone()
    vocab = x.shape[0]
    if p.allowed_token_ids is not None:
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[p.allowed_token_ids] = True
        x[~keep] = -math.inf
    for word in [[ord(ch) for ch in w] for w in p.bad_words or []]:
        if word[:-1] == history[len(history) - len(word) + 1:] or len(word) == 1:
            x[word[-1]] = -math.inf
    if len(history) < p.min_tokens:
        for t in list(eos_ids) + list(p.stop_token_ids or []):
            x[t] = -math.inf
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(history):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(history):
        x[t] -= p.frequency_penalty * history.count(t) + p.presence_penalty
    if p.temperature == 0:
        return x, {int(torch.argmax(x))}, False
    z = x / p.temperature
    order = torch.argsort(z, descending=True, stable=True).tolist()
    vals = z[order].tolist()
    finite = [v for v in vals if v > -math.inf]
    ambiguous = False
    kept = [i for i, v in zip(order, vals) if v > -math.inf]
    if p.top_k > 0 and p.top_k < len(finite):
        kth = finite[p.top_k - 1]
        ambiguous |= 0 < kth - finite[p.top_k] < EPS
        kept = [i for i in kept if z[i] >= kth]
    if p.min_p > 0:
        floor = math.log(p.min_p) + vals[0]
        ambiguous |= any(abs(float(z[i]) - floor) < EPS for i in kept)
        kept = [i for i in kept if z[i] >= floor]
    if p.top_p < 1:
        probs = torch.softmax(z[kept], dim=0).tolist()  # kept is in descending order
        before, inside = 0.0, []
        for i, q in zip(kept, probs):
            if before >= p.top_p:
                ambiguous |= before - q > p.top_p - EPS
                break
            inside.append(i)
            before += q
        ambiguous |= abs(before - p.top_p) < EPS
        kept = inside
    return z, set(kept), ambiguous


def reference(raw_rows, p, prompt, tokens, eos_ids):
    """Per token: (raw logits, processed logits with the dropped ids at -inf, kept, ambiguous)."""
    out = []
    for t, raw in enumerate(raw_rows):
        x, kept, ambiguous = processed_row(raw, p, prompt, tokens[:t], eos_ids)
        masked = torch.full_like(x, -math.inf)
        idx = torch.tensor(sorted(kept))
        masked[idx] = x[idx]
        if p.temperature == 0:
            masked = x  # a greedy row: processed values without temperature or filters
        out.append((raw, masked, kept, ambiguous))
    return out


def check_entries(step, values, token, problems, where):
    """Our {id: Logprob} against reference values [V]: each value within TOL, each rank exact
    unless a neighbour lies within EPS."""
    for tid, lp in step.items():
        ref = float(values[tid])
        if math.isinf(ref) or math.isinf(lp.logprob):
            if ref != lp.logprob:
                problems.append(f"{where} id {tid}: {lp.logprob} vs {ref}")
            continue
        if abs(lp.logprob - ref) > TOL:
            problems.append(f"{where} id {tid}: {lp.logprob} vs {ref}")
        above = int((values > ref + EPS).sum()) + 1
        near = int(((values - ref).abs() <= EPS).sum()) - 1
        if not above <= lp.rank <= above + near:
            problems.append(f"{where} id {tid}: rank {lp.rank} vs {above}..{above + near}")
    assert token in step


@pytest.fixture(scope="module")
def runs(ckpt):
    out = {}
    for mode in ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"):
        with LLM(model=str(ckpt), max_model_len=64, logprobs_mode=mode) as llm:
            out[mode] = (llm.generate(PROMPTS, params_set()), llm.inputs.eos_token_ids)
    return out


@pytest.mark.timeout(180)
def test_every_mode_and_the_mask_equal_transformers_with_the_processing_by_hand(runs, hf):
    problems, ambiguous, checked = [], 0, 0
    tokens_by_mode = {}
    for mode, (outs, eos_ids) in runs.items():
        tokens_by_mode[mode] = [o.outputs[0].token_ids for o in outs]
        for prompt, p, out in zip(PROMPTS, params_set(), outs):
            c = out.outputs[0]
            ref = reference(hf_rows(hf, prompt, c.token_ids), p, prompt, c.token_ids, eos_ids)
            assert len(c.logprobs) == len(c.sampling_mask) == len(c.token_ids) == 16
            for t, (token, step, (raw, proc, kept, amb)) in enumerate(zip(c.token_ids, c.logprobs, ref)):
                where = f"{mode} prompt {PROMPTS.index(prompt)} token {t}"
                assert token in c.sampling_mask[t], where
                if amb:
                    ambiguous += 1
                    continue
                checked += 1
                if set(c.sampling_mask[t]) != kept:
                    problems.append(f"{where}: mask {sorted(c.sampling_mask[t])} vs {sorted(kept)}")
                values = {"raw_logprobs": torch.log_softmax(raw, 0), "raw_logits": raw,
                          "processed_logprobs": torch.log_softmax(proc, 0), "processed_logits": proc}[mode]
                check_entries(step, values, token, problems, where)
                if mode.startswith("processed") and p.temperature > 0:
                    dropped = [tid for tid in step if tid not in kept]
                    assert all(step[tid].logprob == -math.inf for tid in dropped), where
    assert not problems, "\n".join(problems[:20])
    assert checked >= 300 and ambiguous <= checked // 20, (checked, ambiguous)
    # The mode changes what is reported, never what is sampled.
    assert len({json.dumps(v) for v in tokens_by_mode.values()}) == 1
    # The processors acted: the allowed set, the banned words, min_tokens before a stop id.
    raw_tokens = tokens_by_mode["raw_logprobs"]
    assert all(100 <= t < 130 for t in raw_tokens[1])
    assert 99 not in raw_tokens[0] and not any(a == 97 and b == 98 for a, b in zip(raw_tokens[0], raw_tokens[0][1:]))


@pytest.mark.timeout(120)
def test_aggressive_settings_give_no_nan_over_a_thousand_tokens(ckpt):
    params = SamplingParams(n=8, max_tokens=125, temperature=0.05, top_k=3, top_p=0.05, min_p=0.9,
                            repetition_penalty=2.0, frequency_penalty=2.0, presence_penalty=2.0,
                            logit_bias={i: -100.0 for i in range(0, 300, 3)}, logprobs=20, seed=4,
                            return_sampling_mask=True, ignore_eos=True)
    with LLM(model=str(ckpt), max_model_len=160, logprobs_mode="processed_logprobs") as llm:
        (out,) = llm.generate([[1, 2, 3]], params)
    n = 0
    for c in out.outputs:
        for token, step in zip(c.token_ids, c.logprobs):
            n += 1
            assert not any(math.isnan(lp.logprob) for lp in step.values())
            assert step[token].logprob > -math.inf and token % 3 != 0
    assert n == 1000


@pytest.mark.parametrize("kwargs, message", [
    (dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty list"),
    (dict(allowed_token_ids=[1, -2]), "allowed_token_ids must be a non-empty list"),
    (dict(logit_bias=[1, 2]), "logit_bias must be a dict"),
    (dict(logit_bias={1: float("nan")}), "must be a finite number"),
    (dict(logit_bias={"x": 1.0}), "logit_bias keys must be token ids"),
    (dict(bad_words="ab"), "bad_words must be a list of non-empty strings"),
    (dict(bad_words=[""]), "bad_words must be a list of non-empty strings"),
    (dict(return_sampling_mask=1), "return_sampling_mask must be True or False"),
])
def test_bad_processor_arguments_are_named(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.timeout(120)
def test_ids_outside_the_vocabulary_and_an_unknown_mode_are_refused(ckpt, tmp_path):
    with pytest.raises(ConfigError, match="logprobs_mode 'processed' is not one of"):
        LLM(model=str(ckpt), logprobs_mode="processed")
    with LLM(model=str(ckpt), max_model_len=64) as llm:
        for kwargs, name in ((dict(logit_bias={300: 1.0}), "logit_bias"), (dict(allowed_token_ids=[3, 999]), "allowed_token_ids")):
            with pytest.raises(ConfigError, match=f"prompt 0: {name} has token id .* outside the vocabulary"):
                llm.generate([[1, 2]], SamplingParams(**kwargs))
        assert llm.generate([[1, 2]], SamplingParams(temperature=0.0, max_tokens=2))[0].outputs[0].token_ids  # still serves
    # JSON's string keys are token ids too.
    assert SamplingParams(temperature=0.0, logit_bias={"7": 2}).logit_bias == {7: 2.0}
