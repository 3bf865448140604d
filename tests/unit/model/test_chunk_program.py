"""A chunk of layers as the function AOTInductor builds (spmd_engine/compilation/chunk_program.py).

The package reads its weights from the list `ChunkProgram.weights()` gives at every call, so
that list must be the model's live Parameters for as long as the model lives, also after the
program has been through torch.export (which snapshots and restores the exported module's
attributes, rebuilding their containers) and after a weight is replaced by a new Parameter
(`load_weights` repacks packed weights; sleep level 2 replaces them). Getting this wrong serves the old
weights from a compiled engine that built its graphs in its own process.
"""

from __future__ import annotations

import pytest
import torch
from fake_groups import SoloGroup
from model_helpers import make_random_checkpoint
from torch import nn

from spmd_engine.compilation import compiled_layers
from spmd_engine.compilation.chunk_program import ChunkProgram
from spmd_engine.forward_context import set_forward_context
from spmd_engine.kernels.packed_weights import dense_weight, is_packed, pack_linear_weights, repack
from spmd_engine.model import load_model
from spmd_engine.model.layers.attention import AttentionMetadata


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_random_checkpoint(tmp_path_factory.mktemp("chunk") / "m", hidden_size=32, num_layers=2,
                                  num_heads=4, num_kv_heads=2, intermediate_size=64, vocab_size=64)
    model = load_model(path, SoloGroup(), SoloGroup())
    pack_linear_weights(model, batch_hint=4)
    model.allocate_kv_cache(4, 16)
    return model


def _live(model) -> list[torch.Tensor]:
    return [p for layer in model.model.layers.values() for p in layer.parameters()] + [model.model.norm.weight]


def _export(program, model):
    attn = AttentionMetadata.build([0], [3], [[0]], 16, "cpu")
    hidden = torch.randn(3, model.spec.hidden_size)
    cos, sin = model.model.rotary_emb.cos_sin(attn.positions, hidden.dtype)
    example, dims, _ = compiled_layers._export_example(program, cos, sin, hidden, torch.randn_like(hidden), None, False)
    with set_forward_context(attn):
        torch.export.export(program, example, dynamic_shapes=dims, strict=False)


@pytest.mark.timeout(120)
def test_weights_replaced_after_the_export_are_the_ones_it_gives(model):
    program = ChunkProgram(tuple(model.model.layers.values()), model.model.norm)
    assert all(a is b for a, b in zip(program.weights(), _live(model), strict=True))
    _export(program, model)
    assert all(a is b for a, b in zip(program.weights(), _live(model), strict=True))
    # As load_weights does: a packed weight written through its dense form and packed anew (a new
    # Parameter; sleep level 2 replaces packed weights alike); and any Parameter assigned anew.
    qkv = model.model.layers["0"].self_attn.qkv_proj
    assert is_packed(qkv.weight)
    old = qkv.weight
    repack(qkv, dense_weight(qkv.weight) * 2)
    model.model.norm.weight = nn.Parameter(model.model.norm.weight * 3, requires_grad=False)
    weights = program.weights()
    assert qkv.weight is not old and any(w is qkv.weight for w in weights) and not any(w is old for w in weights)
    assert weights[-1] is model.model.norm.weight
    assert all(a is b for a, b in zip(weights, _live(model), strict=True))
