"""The logprobs dicts as vLLM 0.34 builds them (vllm/logprobs.py, v1 worker's sample/logprob.py).

The reference is written out here from vLLM's rules, on torch.log_softmax of the same
logits: the sampled (or prompt) token's entry first, then the top K; the sampled token's
rank is how many vocabulary entries have a logit >= its own (so a tie ranks it last among
the tied); a top-K entry's rank is its place in the top K, which the sampled token takes
too when it is among them; logprobs=-1 is the whole vocabulary.
"""

import pytest
import torch

from spmd_engine.sample.sampler import Sampler, logprob_entries
from spmd_engine.sampling_params import SamplingParams


def vllm_reference(logits: torch.Tensor, token: int, k: int, normalize: bool = True) -> list[tuple[int, float, int]]:
    """[(id, logprob, rank)] in vLLM's dict order, by hand (a stable sort, so ties in the
    top K keep id order: only used where the top K has no ties or is the whole row)."""
    logp = (torch.log_softmax(logits.float(), -1) if normalize else logits.float()).tolist()
    values = logits.float().tolist()
    k = len(values) if k == -1 else k
    top = sorted(range(len(values)), key=lambda i: -values[i])[:k]
    entries = {token: (logp[token], sum(v >= values[token] for v in values))}
    for place, i in enumerate(top, start=1):
        entries[i] = (logp[i], place)
    return [(i, v, r) for i, (v, r) in entries.items()]


def as_list(entry: dict) -> list[tuple[int, float, int]]:
    return [(i, v, r) for i, (v, r) in entry.items()]


def check(got: dict, want: list) -> None:
    assert [i for i, _, _ in as_list(got)] == [i for i, _, _ in want]  # the order
    assert [r for _, _, r in as_list(got)] == [r for _, _, r in want]
    assert [v for _, v, _ in as_list(got)] == pytest.approx([v for _, v, _ in want], abs=1e-6)


def test_sampled_token_comes_first_then_the_top_k_in_rank_order():
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0, 1.0, 0.0]])
    (entry,) = logprob_entries(logits, torch.tensor([4]), [2])  # token 4 is the third most likely
    assert list(entry) == [4, 1, 3]
    assert [r for _, r in entry.values()] == [3, 1, 2]
    check(entry, vllm_reference(logits[0], 4, 2))


def test_rank_counts_every_entry_at_least_as_likely_ties_included():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]])
    for token, rank in ((2, 3), (1, 3), (0, 4), (3, 5)):
        (entry,) = logprob_entries(logits, torch.tensor([token]), [0])
        assert entry == {token: (pytest.approx(float(torch.log_softmax(logits[0], -1)[token])), rank)}
    # The top K are ranked by their place, ties or not, 1..K.
    (entry,) = logprob_entries(logits, torch.tensor([0]), [3])
    assert list(entry)[0] == 0 and set(list(entry)[1:]) == {1, 2, 4}
    assert [r for _, r in entry.values()] == [4, 1, 2, 3]


def test_a_sampled_token_in_the_top_k_takes_its_place_there():
    logits = torch.tensor([[5.0, 1.0, 3.0, 2.0]])
    (entry,) = logprob_entries(logits, torch.tensor([2]), [3])
    assert list(entry) == [2, 0, 3] and [r for _, r in entry.values()] == [2, 1, 3]
    check(entry, vllm_reference(logits[0], 2, 3))


def test_minus_one_is_the_whole_vocabulary_and_ranks_come_from_the_logits():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    tokens = torch.tensor([7, 0, 49])
    entries = logprob_entries(logits, tokens, [-1, 2, -1])
    assert len(entries[0]) == len(entries[2]) == 50
    for row, k in ((0, -1), (1, 2), (2, -1)):
        check(entries[row], vllm_reference(logits[row], int(tokens[row]), k))
        if k == -1:  # every id once, the sampled one at its place
            assert sorted(r for _, r in entries[row].values()) == list(range(1, 51))
    # Not normalised (the *_logits modes): the same order and ranks, the logits as values.
    raw = logprob_entries(logits, tokens, [-1, 2, -1], normalize=False)
    assert [list(e) for e in raw] == [list(e) for e in entries]
    assert raw[0][7][0] == pytest.approx(float(logits[0, 7]))


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs", "processed_logits"])
def test_the_sampler_returns_the_whole_vocabulary_for_minus_one_in_every_mode(mode):
    torch.manual_seed(1)
    logits = torch.randn(2, 40)
    s = Sampler(logprobs_mode=mode)
    s.add_request("g", SamplingParams(logprobs=-1, temperature=0.0), seed=0)
    s.add_request("t", SamplingParams(logprobs=-1, temperature=0.7, top_k=5), seed=1)
    out = s.sample(["g", "t"], logits)
    for row, entry in enumerate(out.logprobs):
        assert len(entry) == 40 and list(entry)[0] == out.token_ids[row]
        assert sorted(r for _, r in entry.values()) == list(range(1, 41))
        after = [r for _, r in list(entry.values())[1:]]
        assert after == sorted(after)  # the rest in rank order
    if mode == "raw_logprobs":
        for row in (0, 1):
            check(out.logprobs[row], vllm_reference(logits[row], out.token_ids[row], -1))
        return
    # The greedy row: its logits unscaled and unfiltered (vLLM's greedy path).
    check(out.logprobs[0], vllm_reference(logits[0], out.token_ids[0], -1, mode == "processed_logprobs"))
    # The sampled row: its distribution, top_k=5 at temperature 0.7, every other id at -inf.
    kept = logits[1].topk(5).indices
    processed = torch.full((40,), float("-inf"))
    processed[kept] = logits[1][kept] / 0.7
    if mode == "processed_logprobs":
        processed[kept] = torch.log_softmax(processed[kept], -1)
    got = {i: v for i, (v, _) in out.logprobs[1].items()}
    assert out.token_ids[1] in kept.tolist()
    assert {i for i, v in got.items() if v > float("-inf")} == set(kept.tolist())
    assert [got[i] for i in kept.tolist()] == pytest.approx(processed[kept].tolist(), abs=1e-5)
    token = out.token_ids[1]  # first, then the other four of the top five, in order
    assert list(got)[:5] == [token] + [i for i in kept.tolist() if i != token]
