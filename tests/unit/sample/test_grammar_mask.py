"""The grammar's packed bitmask in the sampler: unpacked bit for bit, applied before every other
processing (greedy, seeded draws, penalties, min_tokens), seen by processed logprobs only."""

import numpy as np
import torch

from spmd_engine.core.step_messages import GrammarBitmask
from spmd_engine.sample import grammar_mask
from spmd_engine.sample.sampler import Sampler
from spmd_engine.sampling_params import SamplingParams, StructuredOutputsParams

REGEX = StructuredOutputsParams(regex="a")  # any constraint: the sampler reads only the bitmask


def packed(allowed: list[list[int]], vocab: int) -> np.ndarray:
    words = np.zeros((len(allowed), (vocab + 31) // 32), dtype=np.uint32)
    for row, ids in enumerate(allowed):
        for i in ids:
            words[row, i // 32] |= np.uint32(1) << np.uint32(i % 32)
    return words.view(np.int32)


def test_unpack_reads_bit_j_of_word_i_as_id_32i_plus_j_and_pads_beyond_the_mask():
    ids = [0, 31, 32, 63, 64, 69]
    bits = grammar_mask.unpack(packed([ids], 70), 80, "cpu")
    assert bits.shape == (1, 80) and bits[0].nonzero().flatten().tolist() == ids
    assert grammar_mask.unpack(packed([ids], 70), 40, "cpu")[0].nonzero().flatten().tolist() == [0, 31, 32]


def test_every_draw_lands_in_the_mask_and_unmasked_rows_are_untouched():
    torch.manual_seed(0)
    vocab, allowed = 100, [[3, 40, 77], [5]]
    logits = torch.randn(3, vocab) * 3
    s = Sampler()
    s.add_request("a", SamplingParams(temperature=1.0, structured_outputs=REGEX), seed=1)
    s.add_request("b", SamplingParams(temperature=0.0, structured_outputs=REGEX), seed=2)
    s.add_request("c", SamplingParams(temperature=0.0), seed=3)
    grammar = GrammarBitmask(["b", "a"], packed(allowed[::-1], vocab))
    for _ in range(50):
        a, b, c = s.sample(["a", "b", "c"], logits, grammar=grammar).token_ids
        assert a in allowed[0] and b == 5 and c == int(logits[2].argmax())
    # negative control: without the bitmask the same rows leave the grammar
    free = s.sample(["a", "b", "c"], logits).token_ids
    assert free[1] != 5


def test_top_k_penalties_and_seeds_see_only_allowed_ids():
    torch.manual_seed(1)
    logits = torch.randn(1, 64)
    allowed = [int(i) for i in logits[0].argsort()[:4]]  # the four least likely ids
    s = Sampler()
    s.add_request("a", SamplingParams(temperature=1.0, top_k=2, repetition_penalty=1.5,
                                      structured_outputs=REGEX), seed=9)
    grammar = GrammarBitmask(["a"], packed([allowed], 64))
    tokens = {s.sample(["a"], logits, output_index=[i], grammar=grammar).token_ids[0] for i in range(40)}
    top2 = set(logits[0][allowed].argsort(descending=True)[:2].tolist())
    assert tokens == {allowed[i] for i in top2}


def test_processed_logprobs_see_the_mask_and_raw_ones_do_not():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    grammar = GrammarBitmask(["a"], packed([[0, 1]], 4))
    params = SamplingParams(temperature=1.0, logprobs=3, structured_outputs=REGEX)
    raw, processed = Sampler("raw_logprobs"), Sampler("processed_logprobs")
    for s in (raw, processed):
        s.add_request("a", params, seed=0)
    r = raw.sample(["a"], logits, grammar=grammar).logprobs[0]
    p = processed.sample(["a"], logits, grammar=grammar).logprobs[0]
    assert r[3][0] == torch.log_softmax(logits[0], -1)[3].item()
    assert p[3][0] == float("-inf") and abs(p[1][0] - torch.log_softmax(logits[0, :2], -1)[1].item()) < 1e-6


def test_min_tokens_masks_eos_unless_the_grammar_can_only_end():
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0]])  # id 2 is EOS
    s = Sampler()
    s.add_request("a", SamplingParams(temperature=0.0, min_tokens=5, structured_outputs=REGEX), seed=0, stop_ids=[2])
    assert s.sample(["a"], logits, output_index=[0], grammar=GrammarBitmask(["a"], packed([[1, 2]], 4))).token_ids == [1]
    assert s.sample(["a"], logits, output_index=[1], grammar=GrammarBitmask(["a"], packed([[2]], 4))).token_ids == [2]
