"""vLLM's sampling surface through the engine (issue 13): min_p, penalties, min_tokens,
stop_token_ids, top_k=0, prompt_logprobs, and bad values named without harming the engine."""

from __future__ import annotations

import json
import math

import pytest
import torch
from engine_helpers import make_tiny_checkpoint, reference_greedy

from spmd_engine import LLM, SamplingParams
from spmd_engine.config import ConfigError

PROMPT = [3, 17, 42, 99, 5, 17, 42, 8, 250, 3, 17, 61]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=7)


@pytest.fixture(scope="module")
def llm(ckpt):
    with LLM(model=str(ckpt), max_model_len=96, seed=3, max_num_batched_tokens=32) as llm:
        yield llm


def greedy(llm, prompt=PROMPT, **params):
    params = {"temperature": 0.0, **params}  # greedy unless asked (vLLM's default is 1.0)
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=params.pop("max_tokens", 16), ignore_eos=True,
                                                   **params))
    return out.outputs[0]


@torch.inference_mode()
def model_logits(ckpt, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] logits of a no-cache forward of the whole sequence."""
    from spmd_engine.model import load_model
    from spmd_engine.model.solo import SoloGroup
    model = load_model(ckpt, SoloGroup(), SoloGroup())
    hidden = model.forward(torch.tensor([ids]), torch.arange(len(ids))[None, :], None, None)["hidden_states"]
    return model.compute_logits(hidden[0])


def penalised_greedy(ckpt, prompt, max_tokens, rep=1.0, freq=0.0, pres=0.0) -> list[int]:
    """The reference: recompute, penalise token by token in Python (vLLM's formulas), argmax."""
    out = []
    for _ in range(max_tokens):
        logits = model_logits(ckpt, prompt + out)[-1].tolist()
        for t in range(len(logits)):
            count = out.count(t)
            if count or t in prompt:
                logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
            logits[t] -= freq * count + pres * (count > 0)
        out.append(max(range(len(logits)), key=lambda t: (logits[t], -t)))
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("penalty", [dict(repetition_penalty=1.8), dict(frequency_penalty=1.5),
                                     dict(presence_penalty=2.0)])
def test_penalties_equal_a_hand_computation(llm, ckpt, penalty):
    plain = greedy(llm).token_ids
    got = greedy(llm, **penalty).token_ids
    keys = {"repetition_penalty": "rep", "frequency_penalty": "freq", "presence_penalty": "pres"}
    assert got == penalised_greedy(ckpt, PROMPT, 16, **{keys[k]: v for k, v in penalty.items()})
    assert got != plain  # the penalty changes this prompt's greedy output


@pytest.mark.timeout(120)
def test_stop_token_ids_end_with_the_id_kept(llm):
    plain = greedy(llm).token_ids
    stop = plain[4]
    j = plain.index(stop)
    c = greedy(llm, stop_token_ids=[stop, 299])
    assert c.token_ids == plain[:j + 1]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert (greedy(llm).finish_reason, greedy(llm).stop_reason) == ("length", None)


@pytest.mark.timeout(120)
def test_min_tokens_masks_stop_ids_and_eos(llm, ckpt, tmp_path):
    plain = greedy(llm).token_ids
    stop = plain[1]
    c = greedy(llm, stop_token_ids=[stop], min_tokens=6)
    assert len(c.token_ids) >= 6 and stop not in c.token_ids[:6]
    assert c.token_ids[-1] == stop or len(c.token_ids) == 16
    # EOS too: a checkpoint whose EOS is the second greedy token stops there, unless min_tokens.
    eos_ckpt = make_tiny_checkpoint(tmp_path / "eos", seed=7)
    config = json.loads((eos_ckpt / "config.json").read_text())
    (eos_ckpt / "config.json").write_text(json.dumps({**config, "eos_token_id": stop}))
    assert reference_greedy(eos_ckpt, PROMPT, 16, eos=stop) == plain[:plain.index(stop) + 1]
    with LLM(model=str(eos_ckpt), max_model_len=96, distributed_executor_backend="mp") as eos_llm:
        early = eos_llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=16))[0].outputs[0]
        assert early.token_ids == plain[:plain.index(stop) + 1] and early.finish_reason == "stop"
        late = eos_llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=16, min_tokens=6))[0].outputs[0]
        assert len(late.token_ids) >= 6 and stop not in late.token_ids[:6]


@pytest.mark.timeout(120)
def test_min_p_keeps_only_tokens_near_the_top(llm):
    """Sampled at temperature 1: every token's raw probability is >= min_p x the top one's;
    without min_p this high-entropy tiny model samples far below that."""
    def worst_ratio(**params):
        outs = llm.generate([PROMPT, PROMPT[:5]], SamplingParams(max_tokens=24, temperature=1.0, logprobs=1,
                                                                n=4, seed=1, ignore_eos=True, **params))
        worst = 1.0
        for c in (c for o in outs for c in o.outputs):
            for token, step in zip(c.token_ids, c.logprobs):
                top = max(lp.logprob for lp in step.values())
                worst = min(worst, math.exp(step[token].logprob - top))
        return worst
    assert worst_ratio(min_p=0.5) >= 0.5 - 1e-4
    assert worst_ratio() < 0.5


@pytest.mark.timeout(120)
def test_top_k_0_means_no_limit(llm):
    def sample(k):
        return greedy(llm, temperature=1.0, top_k=k, seed=4).token_ids
    assert sample(0) == sample(-1)
    assert sample(0) != sample(1)


@pytest.mark.timeout(180)
def test_prompt_logprobs_equal_the_uncached_forward(llm, ckpt):
    long_prompt = PROMPT * 4  # 48 tokens: two chunks of 32 under this engine's budget
    greedy(llm, prompt=long_prompt, max_tokens=2)  # its blocks are now in the prefix cache
    (out,) = llm.generate([long_prompt], SamplingParams(max_tokens=2, prompt_logprobs=2, n=2, seed=1,
                                                        temperature=1.0))
    lp = out.prompt_logprobs
    assert len(lp) == len(long_prompt) and lp[0] is None
    logp = torch.log_softmax(model_logits(ckpt, long_prompt), dim=-1)
    for j in range(1, len(long_prompt)):
        token = long_prompt[j]
        row = logp[j - 1]
        assert token in lp[j] and len(lp[j]) in (2, 3)
        assert math.isclose(lp[j][token].logprob, float(row[token]), abs_tol=1e-4)
        assert lp[j][token].rank == int((row >= row[token]).sum())  # vLLM: entries at least as likely
        assert {lp[j][t].rank for t in lp[j] if lp[j][t].rank <= 2} == {1, 2}
    assert greedy(llm, prompt=[5], prompt_logprobs=0).token_ids  # a one-token prompt: [None]
    (single,) = llm.generate([[5]], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    assert single.prompt_logprobs == [None]
    (none,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=1))
    assert none.prompt_logprobs is None


@pytest.mark.timeout(180)
def test_everything_at_once_is_the_same_under_tp2_pp2(llm, ckpt):
    """Penalties' token history, min_tokens and prompt logprobs live on the last stage's ranks:
    TP2 x PP2 worker processes give what one process gives."""
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=5, min_p=0.05, repetition_penalty=1.3,
                            frequency_penalty=0.5, presence_penalty=0.2, min_tokens=3, top_k=0,
                            stop_token_ids=[greedy(llm).token_ids[2]], prompt_logprobs=1, logprobs=1)
    prompts = [PROMPT * 3, PROMPT[:4]]
    one = llm.generate(prompts, params)
    with LLM(model=str(ckpt), max_model_len=96, seed=3, max_num_batched_tokens=32, tensor_parallel_size=2,
             pipeline_parallel_size=2) as other:
        four = other.generate(prompts, params)
    for a, b in zip(one, four):
        ca, cb = a.outputs[0], b.outputs[0]
        assert (ca.token_ids, ca.finish_reason, ca.stop_reason) == (cb.token_ids, cb.finish_reason, cb.stop_reason)
        assert ca.cumulative_logprob == pytest.approx(cb.cumulative_logprob, abs=1e-3)
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.keys() == y.keys()
            assert all(x[t].logprob == pytest.approx(y[t].logprob, abs=1e-4) for t in x)


@pytest.mark.timeout(240)
def test_preemption_with_steps_in_flight_changes_no_draw_and_no_penalty(llm, ckpt):
    """mp PP=2 keeps two steps in flight; a tiny KV cache preempts requests meanwhile and their
    in-flight tokens are dropped. The draw's position and the penalties' history come from the
    schedule, so the outputs equal one process with room for everything."""
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=9, repetition_penalty=1.4,
                            frequency_penalty=0.6, min_tokens=4, stop_token_ids=[1], ignore_eos=True)
    prompts = [PROMPT[i:i + 3 + i % 4] for i in range(8)]  # each grows past one 16-token block
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    # PP=2: 2 layers x 2 KV heads x 8 dims x fp32 x (K, V) = 256 bytes per token per rank.
    with LLM(model=str(ckpt), max_model_len=32, seed=3, pipeline_parallel_size=2,
             kv_cache_memory_bytes=3 * 16 * 256) as tight:
        got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
        stats = tight.get_stats()[0]
    assert stats["preemptions"] > 0 and stats["peak_in_flight"] == 2
    assert got == ref


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kwargs,name", [
    (dict(min_p=2), "min_p"), (dict(min_p=-0.1), "min_p"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(presence_penalty=3), "presence_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=20, max_tokens=4), "min_tokens"),
    (dict(stop_token_ids=["a"]), "stop_token_ids"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(prompt_logprobs=-2), "prompt_logprobs"), (dict(top_k=-2), "top_k")])
def test_bad_values_are_named_and_the_engine_keeps_working(llm, kwargs, name):
    with pytest.raises(ConfigError, match=name):
        SamplingParams(**kwargs)
    assert len(greedy(llm, max_tokens=3).token_ids) == 3
