"""hf_named_parameters: the trainer model's weights back under the checkpoint's names and shapes
(what load_weights takes), for a tied and an untied Llama with biases."""

import pytest
import torch
from engine_helpers import make_tiny_checkpoint
from safetensors.torch import load_file

from spmd_engine.model.trainer import hf_named_parameters, trainer_model


@pytest.mark.parametrize("overrides", [dict(), dict(tie_word_embeddings=True, attention_bias=True)],
                         ids=["untied", "tied-bias"])
def test_export_equals_the_checkpoint(tmp_path, overrides):
    path = make_tiny_checkpoint(tmp_path, vocab_size=250, **overrides)  # 250: the vocabulary is padded
    ours = dict(hf_named_parameters(trainer_model(path)))
    ref = load_file(str(path / "model.safetensors"))
    ref.pop("lm_head.weight", None) if overrides else None
    assert sorted(ours) == sorted(ref)
    assert all(torch.equal(ours[k], ref[k]) for k in ref)
