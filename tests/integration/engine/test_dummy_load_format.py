"""load_format="dummy" (vLLM's): random weights from config.json alone, the same model under
every layout. verl starts its rollout engine this way and relies on the ranks being in sync
before the trainer's first weight push: each TP or PP shard is a slice of one full tensor drawn
from a seed of its name, so TP 2 and PP 2 generate what TP 1 does, and after the real tensors
are pushed the engine generates what a normal load of them does."""

from __future__ import annotations

import pytest
from engine_helpers import make_tiny_checkpoint, reference_greedy
from safetensors.torch import load_file

from spmd_engine import LLM, SamplingParams

PROMPTS = [list(range(1, 40)), [4, 5, 6, 7, 8], [9, 10]]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("real"), seed=1)


@pytest.fixture(scope="module")
def bare(ckpt, tmp_path_factory):
    """config.json only: no safetensors for the dummy format to read, or to need."""
    out = tmp_path_factory.mktemp("config_only")
    (out / "config.json").write_text((ckpt / "config.json").read_text())
    return out


def tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def dummy_tp1(bare):
    with LLM(model=str(bare), max_model_len=64, load_format="dummy") as llm:
        return tokens(llm)


@pytest.mark.timeout(120)
def test_dummy_weights_are_a_model_not_noise_and_the_same_every_time(bare, dummy_tp1, ckpt):
    # Distinct greedy tokens: logits far enough apart that no layout's rounding decides them.
    assert len({t for row in dummy_tp1 for t in row}) > 4, dummy_tp1
    assert dummy_tp1 != [reference_greedy(ckpt, p, MAX_TOKENS) for p in PROMPTS]
    with LLM(model=str(bare), max_model_len=64, load_format="dummy", seed=7) as llm:
        assert tokens(llm) == dummy_tp1  # a fixed seed per tensor name, not the engine seed


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)],
                         ids=["tp2", "pp2"])
def test_every_layout_builds_the_tp1_dummy_model_then_takes_the_real_weights(bare, ckpt, dummy_tp1, layout):
    real = load_file(str(ckpt / "model.safetensors"))
    with LLM(model=str(bare), max_model_len=64, load_format="dummy", distributed_executor_backend="mp",
             **layout) as llm:
        assert tokens(llm) == dummy_tp1
        llm.collective_rpc("load_weights", args=(list(real.items()),))
        llm.reset_prefix_cache()
        assert tokens(llm) == [reference_greedy(ckpt, p, MAX_TOKENS) for p in PROMPTS]
