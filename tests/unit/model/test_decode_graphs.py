"""worker/decode_graphs.py without CUDA (capture=False): the padding to a graph's size, the
spare block that padding rows write, the fixed buffers reused across batches of other sizes,
and capturing again when the model's memory moved. The capture itself needs a GPU
(tests/integration/engine/test_cuda_graphs.py)."""

from __future__ import annotations

import pytest
import torch
from make_random_checkpoint import make_random_checkpoint
from model_helpers import LLAMA

from spmd_engine.model import load_model
from spmd_engine.model.layers.attention import AttentionMetadata
from spmd_engine.model.solo import SoloGroup
from spmd_engine.worker.decode_graphs import DecodeGraphs, default_sizes

BS, BLOCKS = 4, 24  # block size; blocks the scheduler may hand out (the cache holds one more)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", **LLAMA)
    g = SoloGroup()
    return load_model(str(path), g, g)


def test_default_sizes_are_vllms_up_to_the_first_holding_max_num_seqs():
    assert default_sizes(1) == [1]
    assert default_sizes(8) == [1, 2, 4, 8]
    assert default_sizes(10) == [1, 2, 4, 8, 16]
    assert default_sizes(256)[-1] == 256 and default_sizes(10_000)[-1] == 512


def _caches(model, blocks):
    torch.manual_seed(1)  # finite, nonzero history in every block
    shape = model.kv_cache_shape(blocks, BS)
    return [(torch.randn(shape), torch.randn(shape)) for _ in model._attention_layers()]


@torch.inference_mode()
def test_padded_steps_equal_plain_ones_and_padding_writes_only_the_spare_block(model):
    """Steps of 7, 3, 5 and 1 requests through graphs of sizes 1, 4, 8 (so padding rows, and
    buffers last filled by a larger step) against the same steps run plainly on a copy of the
    cache: the same logits and hidden states, and the same cache outside the spare block."""
    plain = _caches(model, BLOCKS + 1)
    mine = [(k.clone(), v.clone()) for k, v in plain]
    spare = BLOCKS
    graphs = DecodeGraphs(model, [1, 4, 8], max_blocks_per_seq=6, spare_block=spare, block_size=BS,
                          device="cpu", capture=False)
    tables = [[(7 * r + j) % BLOCKS for j in range(6)] for r in range(7)]
    for step_no, rows in enumerate([[0, 1, 2, 3, 4, 5, 6], [6, 2, 0], [1, 3, 5, 4, 2], [3]]):
        ctx = [3 + 2 * r + step_no for r in rows]
        attn = AttentionMetadata.build(ctx, [1] * len(rows), [tables[r] for r in rows], BS, "cpu")
        ids = torch.tensor([(11 * r + step_no) % LLAMA["vocab_size"] for r in rows])
        model.bind_kv_cache(plain)
        want = model.forward(ids, attn.positions, attn)["hidden_states"]
        want_logits = model.compute_logits(want)
        model.bind_kv_cache(mine)
        hidden, logits = graphs.run(ids, attn.positions, attn.decode_step())
        assert hidden.shape == want.shape and logits.shape == want_logits.shape
        torch.testing.assert_close(hidden, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
        for (pk, pv), (mk, mv) in zip(plain, mine):
            torch.testing.assert_close(mk[:spare], pk[:spare], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(mv[:spare], pv[:spare], rtol=1e-5, atol=1e-5)
    assert (graphs.captures, graphs.steps) == (1, 4)
    model.bind_kv_cache(None)


@torch.inference_mode()
def test_the_graphs_capture_again_when_the_model_memory_moved(model):
    """New cache tensors (wake_up after sleep) or a replaced weight: the addresses captured
    against are gone, so the next step captures every size again before it runs."""
    graphs = DecodeGraphs(model, [2], max_blocks_per_seq=4, spare_block=BLOCKS, block_size=BS, device="cpu",
                          capture=False)
    attn = AttentionMetadata.build([5, 6], [1, 1], [[0, 1], [2, 3]], BS, "cpu")
    ids = torch.tensor([1, 2])
    model.bind_kv_cache(_caches(model, BLOCKS + 1))
    graphs.run(ids, attn.positions, attn.decode_step())
    graphs.run(ids, attn.positions, attn.decode_step())
    assert graphs.captures == 1
    model.bind_kv_cache(_caches(model, BLOCKS + 1))
    graphs.run(ids, attn.positions, attn.decode_step())
    assert graphs.captures == 2
    norm = model.model.norm
    norm.weight = torch.nn.Parameter(norm.weight.detach().clone(), requires_grad=False)
    graphs.run(ids, attn.positions, attn.decode_step())
    assert graphs.captures == 3
    model.bind_kv_cache(None)


def test_a_step_above_the_largest_size_or_wider_than_the_tables_is_refused(model):
    graphs = DecodeGraphs(model, [1, 2], max_blocks_per_seq=2, spare_block=BLOCKS, block_size=BS, device="cpu",
                          capture=False)
    model.bind_kv_cache(_caches(model, BLOCKS + 1))
    assert graphs.size_for(3) is None and graphs.size_for(2) == 2
    attn = AttentionMetadata.build([5, 6, 7], [1] * 3, [[0, 1]] * 3, BS, "cpu")
    with pytest.raises(ValueError, match="above the largest graph"):
        graphs.run(torch.tensor([1, 2, 3]), attn.positions, attn.decode_step())
    wide = AttentionMetadata.build([13], [1], [[0, 1, 2, 3]], BS, "cpu")
    with pytest.raises(ValueError, match="wide"):
        graphs.run(torch.tensor([1]), wide.positions, wide.decode_step())
    model.bind_kv_cache(None)
