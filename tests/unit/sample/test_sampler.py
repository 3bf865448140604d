"""Sampling: greedy, temperature/top-k/top-p/min_p, penalties, min_tokens, seeds independent of
batching, the vectorised draw against a per-row reference, logprobs."""

import pytest
import torch

from spmd_engine.config import ConfigError
from spmd_engine.sample import draw as sample_draw
from spmd_engine.sample.penalties import apply_penalties
from spmd_engine.sample.sampler import RequestState, Sampler, greedy_tokens
from spmd_engine.sampling_params import SamplingParams


def test_greedy_is_argmax_and_logprobs_hold_sampled_then_top_k():
    s = Sampler()
    s.add_request("a", SamplingParams(logprobs=2, temperature=0.0), seed=0)
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    out = s.sample(["a"], logits)
    tokens, logprobs = out.token_ids, out.logprobs
    assert tokens == [1]
    expected = torch.log_softmax(logits[0], -1)
    assert list(logprobs[0]) == [1, 3]  # the sampled token first, then the top 2 (itself again)
    assert logprobs[0][3] == (pytest.approx(float(expected[3])), 2)  # (logprob, rank)
    assert logprobs[0][1] == (pytest.approx(float(expected[1])), 1)
    # logprobs=0: the sampled token alone, with its rank in the distribution.
    s.add_request("b", SamplingParams(logprobs=0, temperature=1.0), seed=1)
    out = s.sample(["b"], logits)
    tokens, logprobs = out.token_ids, out.logprobs
    (token,) = tokens
    assert list(logprobs[0]) == [token]
    assert logprobs[0][token][1] == int((expected >= expected[token]).sum())


def test_plain_greedy_rows_take_the_short_path_with_the_general_paths_result():
    """Greedy with nothing else (no logprobs, mask, processors, penalties, live min_tokens) goes
    straight to the argmax: the same tokens and draw counts as the general path (forced by
    marking the states not plain), ties and NaNs included; every other setting is not plain."""
    torch.manual_seed(0)
    logits = torch.randn(6, 300).bfloat16()
    logits[1, 7] = logits[1, 200] = 9.0  # a tie: the earlier index
    logits[2, 50] = float("nan")
    short, general = Sampler(), Sampler()
    for sampler in (short, general):
        for i in range(6):
            sampler.add_request(str(i), SamplingParams(temperature=0.0, min_tokens=3), seed=i)  # no stop ids
    for state in general.requests.values():
        state.plain = False
    assert all(state.plain for state in short.requests.values())
    taken = Sampler()  # the tokens from elsewhere (the LM head's fused argmax): take_greedy
    for i in range(6):
        taken.add_request(str(i), SamplingParams(temperature=0.0, min_tokens=3), seed=i)
    ids = [str(i) for i in (3, 1, 0, 5, 2, 4)]
    assert taken.all_plain(ids) and not general.all_plain(ids)
    for _ in range(2):
        tokens = general.sample(ids, logits).token_ids
        assert short.sample(ids, logits).token_ids == tokens
        assert taken.take_greedy(ids, greedy_tokens(logits.float())).token_ids == tokens
    counts = [r.num_sampled for r in general.requests.values()]
    assert [r.num_sampled for r in short.requests.values()] == counts == [r.num_sampled for r in taken.requests.values()]
    out = short.sample(ids, logits)
    assert out.token_ids[1] == 7 and out.token_ids[2] == 50 and out.logprobs is None  # rows, not ids
    for other in (dict(temperature=1.0), dict(logprobs=0), dict(return_sampling_mask=True),
                  dict(allowed_token_ids=[1]), dict(bad_words=["x"]), dict(logit_bias={1: 1.0}),
                  dict(repetition_penalty=1.1), dict(presence_penalty=0.5)):
        assert not RequestState(SamplingParams(**{"temperature": 0.0, **other}), 0).plain, other
    assert not RequestState(SamplingParams(temperature=0.0, min_tokens=2), 0, stop_ids=[2]).plain


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_greedy_tokens_are_argmax_through_ties_nans_and_infinities(threads):
    """The greedy path takes max(dim)'s index on CPU (faster than argmax): the same first index
    of tied maxima, a NaN's where a row has one, whatever the row length, stride or threads."""
    gen = torch.Generator().manual_seed(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for trial in range(400):
            rows, vocab = int(torch.randint(1, 40, (), generator=gen)), int(torch.randint(1, 3000, (), generator=gen))
            x = torch.randn(rows, vocab, generator=gen)
            if trial % 4 == 1:  # few distinct values: many ties, some over a thread's share
                x = torch.randint(0, 3, (rows, vocab), generator=gen).float()
            elif trial % 4 == 2:
                x[torch.rand(rows, vocab, generator=gen) < 0.01] = float("nan")
            elif trial % 4 == 3:
                x[torch.rand(rows, vocab, generator=gen) < 0.05] = float("inf")
                x[torch.rand(rows, vocab, generator=gen) < 0.3] = -float("inf")
            if trial % 5 == 0:
                x = x[:, : max(1, vocab // 2)]  # rows with a stride
            assert torch.equal(greedy_tokens(x), x.argmax(dim=-1)), trial
    finally:
        torch.set_num_threads(before)


def test_seeded_stream_does_not_depend_on_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)

    seeds = {"a": 11, "b": 22, "c": 33}  # fixed: hash(str) changes with every interpreter

    def draws(batch_ids, rows, seeds=seeds):
        s = Sampler()
        for rid in batch_ids:
            s.add_request(rid, params, seed=seeds[rid])
        return [s.sample(batch_ids, logits[rows]).token_ids for _ in range(8)]

    alone = draws(["b"], [1])
    batched = draws(["a", "b", "c"], [0, 1, 2])
    assert [t[0] for t in alone] == [t[1] for t in batched]
    # Negative control: the stream is the seed's (another seed for "b" draws other tokens).
    assert [t[0] for t in draws(["b"], [1], {"b": 23})] != [t[0] for t in alone]


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = torch.tensor([[0.1, 0.5, 4.0, 0.2]])
    for params in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6)):
        s = Sampler()
        s.add_request("x", params, seed=3)
        assert all(s.sample(["x"], logits).token_ids == [2] for _ in range(10))


@pytest.mark.parametrize("kwargs", [{"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_p": 1.5},
                                    {"top_k": -2}, {"logprobs": -2}, {"prompt_logprobs": -2}])
def test_invalid_sampling_params(kwargs):
    with pytest.raises(ConfigError):
        SamplingParams(**kwargs)


# -- the vectorised draw against a per-row reference -------------------------------------------

def reference_probs(row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float):
    """vLLM's order, one row at a time with a full sort: temperature, min_p, top_k (ties of the
    k-th value kept), renormalise, top_p (smallest prefix reaching top_p, ties kept)."""
    row = row.double()
    probs = torch.softmax(row / temperature, dim=-1)
    keep = probs >= min_p * probs.max()
    if top_k > 0:
        keep &= row >= torch.sort(row, descending=True).values[top_k - 1]
    probs = torch.where(keep, probs, 0.0)
    probs = probs / probs.sum()
    if top_p < 1:
        desc = torch.sort(probs, descending=True).values
        inside = (torch.cumsum(desc, 0) - desc) < top_p
        probs = torch.where(probs >= desc[inside].min(), probs, 0.0)
        probs = probs / probs.sum()
    return probs


@pytest.mark.parametrize("bounded", [True, False])
@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (0.8, 3, 0.9, 0.0), (1.0, 4, 1.0, 0.0), (0.7, 0, 0.8, 0.0), (1.3, 0, 1.0, 0.05), (1.0, 0, 1.0, 0.0),
    (0.5, 4, 0.95, 0.2)])
def test_draw_is_inverse_cdf_of_the_reference_distribution(temperature, top_k, top_p, min_p, bounded):
    """N rows of the same logits with uniforms on a grid: every token's share of the draws is
    its reference probability within 1/N (exact for inverse-CDF sampling)."""
    torch.manual_seed(1)
    vocab, n = 4096, 2000
    row = (torch.randn(vocab) * 2).bfloat16().float()  # bf16: ties, as real logits have
    grid = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    tokens = sample_draw.draw(row.expand(n, vocab), [temperature] * n, [top_k] * n, [top_p] * n, [min_p] * n,
                              grid, bounded=bounded)
    freq = torch.bincount(tokens, minlength=vocab).double() / n
    expected = reference_probs(row, temperature, top_k, top_p, min_p)
    assert float((freq - expected).abs().max()) <= 1 / n + 1e-6
    assert bool((freq[expected == 0] == 0).all())  # nothing outside the filtered support


def test_bounded_top_k_path_equals_the_full_path_including_ties():
    torch.manual_seed(2)
    rows, vocab = 48, 8192
    x = (torch.randn(rows, vocab) * 3).bfloat16().float()
    x[5, :300] = 20.0  # 300 tied maxima: the chunk shortcut cannot prove its set, falls back
    x[6, torch.arange(0, vocab, 64)] = 15.0  # one tie in every chunk
    ks = [1 + (i % 12) for i in range(rows)]
    temps = [0.3 + 0.05 * i for i in range(rows)]
    top_p = [1.0 if i % 3 == 0 else 0.5 + 0.01 * i for i in range(rows)]
    min_p = [0.0 if i % 4 else 0.1 for i in range(rows)]
    # Whole chunks, a partial last chunk, and a strided (non-contiguous) view of the logits.
    for logits in (x, x[:, :vocab - 37].contiguous(), x[:, :vocab - 37]):
        for step in range(3):
            u = sample_draw.uniforms(list(range(rows)), [step] * rows)
            fast = sample_draw.draw(logits, temps, ks, top_p, min_p, u)
            full = sample_draw.draw(logits, temps, ks, top_p, min_p, u, bounded=False)
            assert fast.tolist() == full.tolist()
        assert int(fast[5]) < 300 and x[6, int(fast[6])] == 15.0


def test_uniforms_depend_on_seed_and_position_only():
    u = sample_draw.uniforms([1, 2, 1, 2**70 + 1], [0, 0, 1, 0])
    assert u.dtype == torch.float64 and bool(((u >= 0) & (u < 1)).all())
    assert len(set(u[:3].tolist())) == 3
    assert float(u[3]) == float(sample_draw.uniforms([1], [0])[0])  # seeds are taken mod 2**64
    assert sample_draw.uniforms([7, 1], [3, 0])[0] == sample_draw.uniforms([7], [3])[0]


def test_seeded_draws_do_not_depend_on_batch_composition_at_scale():
    """The bounded path (large vocabulary), beside greedy, penalised and min_tokens rows."""
    torch.manual_seed(3)
    vocab = 8192
    logits = torch.randn(4, vocab) * 0.3  # flat: the top 20 share the mass
    params = {"a": SamplingParams(temperature=0.8, top_k=20, top_p=0.9),
              "b": SamplingParams(temperature=0.8, top_k=20, top_p=0.9),
              "g": SamplingParams(temperature=0.0),
              "p": SamplingParams(temperature=1.0, repetition_penalty=1.3, min_tokens=2)}
    rows = {"a": 0, "b": 1, "g": 2, "p": 3}

    def draws(batch, seed_b=22):
        s = Sampler()
        for rid in batch:
            s.add_request(rid, params[rid], seed={"a": 11, "b": seed_b, "g": 0, "p": 44}[rid], stop_ids=[5])
        return [s.sample(batch, logits[[rows[r] for r in batch]]).token_ids for _ in range(6)]

    alone = [t[0] for t in draws(["b"])]
    assert [t[1] for t in draws(["a", "b", "g", "p"])] == alone
    assert [t[2] for t in draws(["g", "p", "b"])] == alone
    assert [t[0] for t in draws(["b"], seed_b=23)] != alone


# -- logit processing -----------------------------------------------------------------------------

def test_penalties_match_a_hand_computation():
    torch.manual_seed(4)
    vocab = 12
    logits = torch.randn(2, vocab) * 2
    p = SamplingParams(temperature=0.0, repetition_penalty=1.7, frequency_penalty=0.4, presence_penalty=0.3)
    state = RequestState(p, 0, prompt_token_ids=[1, 2, 2], output_token_ids=[2, 3, 3, 3, 11])
    x = logits.clone()
    apply_penalties(x, [1], [state])
    expected = logits[1].clone()
    for t in range(vocab):
        count = state.output_token_ids.count(t)
        if t in state.prompt_token_ids or count:
            expected[t] = expected[t] / 1.7 if expected[t] > 0 else expected[t] * 1.7
        expected[t] -= 0.4 * count + 0.3 * (count > 0)
    assert torch.allclose(x[1], expected) and torch.equal(x[0], logits[0])
    assert not torch.allclose(x[1], logits[1])


def test_min_tokens_masks_stop_ids_then_lets_them_through():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0]])  # greedy picks 1, then 3 once 1 is masked
    s = Sampler()
    s.add_request("r", SamplingParams(temperature=0.0, min_tokens=2, max_tokens=4), seed=0, stop_ids=[1, 9])
    assert [s.sample(["r"], logits).token_ids[0] for _ in range(3)] == [3, 3, 1]


def test_min_p_drops_unlikely_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.1]]))
    for min_p, allowed in ((0.0, {0, 1, 2, 3}), (0.5, {0, 1})):
        s = Sampler()
        s.add_request("r", SamplingParams(temperature=1.0, min_p=min_p), seed=5)
        seen = {s.sample(["r"], logits).token_ids[0] for _ in range(300)}
        assert seen == allowed
