"""Sleep mode for colocated training (issue 13): `sleep(1)` gives the KV cache back, `sleep(2)`
the weights too; `wake_up` (all, or by tag) and a weight reload restore identical outputs."""

from __future__ import annotations

import pytest
from engine_helpers import make_tiny_checkpoint

from spmd_engine import LLM, SamplingParams
from spmd_engine.config import ConfigError

PROMPTS = [list(range(1, 40)), [4, 5, 6, 7, 8], [9, 10]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# The tiny model: 512 bytes of K/V per token at TP=1. 8 MiB of blocks, every one written by FILL.
KV_BYTES = 8 << 20
FILL = [[(7 * i + j) % 290 + 1 for j in range(56)] for i in range(256)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=3)


def tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.timeout(120)
def test_sleep_1_then_wake_up_gives_identical_outputs_and_frees_the_kv_cache(ckpt):
    with LLM(model=str(ckpt), max_model_len=64, enable_sleep_mode=True, kv_cache_memory_bytes=KV_BYTES) as llm:
        want = tokens(llm)
        llm.generate(FILL, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # touch every KV page
        assert llm.get_stats()[0]["num_blocks"] * 16 * 512 == KV_BYTES
        rss_before = llm.collective_rpc("memory_usage")[0]["rss_bytes"]
        (report,) = llm.sleep(level=1)
        rss_after = llm.collective_rpc("memory_usage")[0]["rss_bytes"]
        assert rss_before - rss_after > KV_BYTES // 2, (rss_before, rss_after)
        assert report["freed_bytes"] > KV_BYTES // 2 and report["rss_after"] < report["rss_before"]
        assert llm.is_sleeping
        with pytest.raises(RuntimeError, match="asleep.*wake_up"):
            llm.generate(PROMPTS, GREEDY)
        llm.wake_up()
        assert not llm.is_sleeping
        assert tokens(llm) == want


@pytest.mark.timeout(120)
def test_sleep_2_discards_weights_until_reload_then_identical_outputs(ckpt):
    with LLM(model=str(ckpt), max_model_len=64, enable_sleep_mode=True) as llm:
        want = tokens(llm)
        model = llm.llm_engine.model_executor.driver_worker.model_runner.model
        llm.sleep(level=2)
        assert all(p.numel() == 0 for p in model.parameters())  # the weights are gone
        # vLLM's order for an update after sleep(2): weights, load them, then the KV cache.
        llm.wake_up(tags=["weights"])
        with pytest.raises(RuntimeError, match="asleep \\(kv_cache"):
            llm.generate(PROMPTS, GREEDY)
        assert llm.collective_rpc("reload_weights")
        llm.wake_up(tags=["kv_cache"])
        assert tokens(llm) == want
        # wake_up() after sleep(2) without a load: storage, but no weights: generate refuses.
        llm.sleep(level=2)
        llm.wake_up()
        with pytest.raises(RuntimeError, match="discarded the weights: load_weights"):
            llm.generate(PROMPTS, GREEDY)
        # A reload straight after sleep(2), without wake_up(["weights"]) first, also restores them.
        llm.sleep(level=2)
        llm.collective_rpc("reload_weights")
        llm.wake_up()
        assert tokens(llm) == want


@pytest.mark.timeout(120)
def test_sleep_2_restored_by_load_weights_with_packed_and_tied_weights(tmp_path):
    from safetensors.torch import load_file
    ckpt = make_tiny_checkpoint(tmp_path / "tied", seed=4, tie_word_embeddings=True)
    with LLM(model=str(ckpt), max_model_len=64, enable_sleep_mode=True) as llm:
        want = tokens(llm)
        model = llm.llm_engine.model_executor.driver_worker.model_runner.model
        llm.sleep(level=2)
        model.load_weights(load_file(str(ckpt / "model.safetensors")).items())
        llm.wake_up()
        assert tokens(llm) == want


@pytest.mark.timeout(120)
def test_sleep_bad_input_and_refusals(ckpt):
    with LLM(model=str(ckpt), max_model_len=64) as llm:
        with pytest.raises(ConfigError, match="enable_sleep_mode=True"):
            llm.sleep()
    with LLM(model=str(ckpt), max_model_len=64, enable_sleep_mode=True) as llm:
        want = tokens(llm)
        with pytest.raises(ValueError, match="level=3"):
            llm.sleep(level=3)
        with pytest.raises(ValueError, match=r"tags=\['x'\]"):
            llm.wake_up(tags=["x"])
        # A request holding blocks (as if a generate were still running): sleep refuses.
        from spmd_engine.core.request import Request
        engine = llm.llm_engine.engine_core
        engine.add_request(Request("held", [1, 2, 3], GREEDY, seed=0))
        engine.step()
        with pytest.raises(RuntimeError, match="cannot sleep: 1 requests unfinished"):
            llm.sleep(level=1)
        engine.run_until_done()
        assert not llm.is_sleeping
        assert tokens(llm) == want
        llm.sleep(level=1)
        llm.wake_up(tags=["kv_cache"])
        llm.wake_up(tags=["weights"])
        assert tokens(llm) == want


@pytest.mark.timeout(180)
def test_mp_tp2_sleep_round_trips(ckpt):
    with LLM(model=str(ckpt), max_model_len=64, enable_sleep_mode=True, tensor_parallel_size=2,
             distributed_executor_backend="mp") as llm:
        want = tokens(llm)
        reports = llm.sleep(level=1)
        assert len(reports) == 2 and len({r["pid"] for r in reports}) == 2
        llm.wake_up()
        assert tokens(llm) == want
        llm.sleep(level=2)
        llm.collective_rpc("reload_weights")
        llm.wake_up()
        assert tokens(llm) == want


@pytest.mark.timeout(120)
def test_sleep_2_then_a_partial_load_refuses_to_generate_until_every_tensor_is_back(ckpt):
    """A trainer that stops half way through its push must not leave an engine serving a mix of
    uninitialised and loaded tensors; reload_weights keeps what was loaded (no silent revert)."""
    from safetensors.torch import load_file
    with LLM(model=str(ckpt), max_model_len=64, enable_sleep_mode=True) as llm:
        want = tokens(llm)
        model = llm.llm_engine.model_executor.driver_worker.model_runner.model
        pairs = sorted(load_file(f"{ckpt}/model.safetensors").items())
        llm.sleep(level=2)
        llm.wake_up(tags=["weights"])
        model.load_weights(pairs[:3])
        assert llm.collective_rpc("reload_weights") == [set()]
        llm.wake_up(tags=["kv_cache"])
        with pytest.raises(RuntimeError, match=f"{len(pairs) - 3} tensors have not been loaded since"):
            llm.generate(PROMPTS, GREEDY)
        model.load_weights(pairs[3:])
        assert tokens(llm) == want
