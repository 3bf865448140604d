"""LoRA adapters through `LLM` (uni), against transformers + PEFT (the reference).

Adapters are made by PEFT itself with random, non-zero A and B (lora_helpers.py). Each test
compares what the engine generates with what PEFT computes on the same tokens, or what an
adapter gives alone with what it gives batched with others, or after the caches were used by
another adapter. Launches (mp, torchrun) are in tests/integration/distributed/test_lora_layouts.py.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field

import pytest
import torch
from lora_helpers import adapter_tensors, make_adapter, peft_model, reference_greedy, reference_logprobs

from spmd_engine import LLM, SamplingParams
from spmd_engine.engine.lora_adapters import LoRAAdapters
from spmd_engine.lora_request import LoRARequest
from spmd_engine.model.lora.peft_files import LoRAAdapterError

pytestmark = pytest.mark.timeout(300)

PROMPT = [256] + list(b"The quick brown fox jumps over the lazy dog. ")  # three blocks of 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True)


@pytest.fixture(scope="module")
def bundled():
    from pathlib import Path

    import spmd_engine
    return Path(spmd_engine.__file__).parent / "bundled"


@pytest.fixture(scope="module")
def adapters(bundled, tmp_path_factory):
    """Three PEFT adapters: every target at r 8; a subset at r 16 with rslora; MLP only at r 4."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all": make_adapter(bundled, root / "all", r=8, alpha=16, seed=1, scale=0.6),
        "rs": make_adapter(bundled, root / "rs", r=16, alpha=8, rslora=True, seed=2, scale=0.8,
                           targets=["q_proj", "v_proj", "o_proj", "down_proj"]),
        "mlp": make_adapter(bundled, root / "mlp", r=4, alpha=4, seed=3, scale=0.8,
                            targets=["gate_proj", "up_proj", "down_proj"]),
    }


def engine(**kwargs) -> LLM:
    kwargs = {"enable_lora": True, "max_loras": 3, "max_lora_rank": 16, "dtype": "float32", "enforce_eager": True,
              **kwargs}
    return LLM(**kwargs)


def run(llm, requests, prompt=PROMPT, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": prompt}] * len(requests), params, lora_request=requests)
    return [(list(o.outputs[0].token_ids), [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def test_a_mixed_batch_gives_each_request_what_peft_gives(bundled, adapters):
    """Base and three adapters (ranks 4, 8, 16; alpha/r and rslora; attention, MLP, both) in one
    batch: greedy tokens equal PEFT's and logprobs within fp32 rounding of PEFT's."""
    from transformers import AutoModelForCausalLM
    names = ["all", "rs", "mlp"]
    llm = engine()
    requests = [None] + [LoRARequest(n, i + 1, str(adapters[n])) for i, n in enumerate(names)]
    got = run(llm, requests)
    refs = [AutoModelForCausalLM.from_pretrained(str(bundled), dtype=torch.float32).eval()]
    refs += [peft_model(bundled, adapters[n]) for n in names]
    for (tokens, logprobs), ref in zip(got, refs):
        assert tokens == reference_greedy(ref, PROMPT, len(tokens))
        assert max(abs(a - b) for a, b in zip(logprobs, reference_logprobs(ref, PROMPT, tokens))) < 1e-4
    assert len({tuple(t) for t, _ in got}) >= 3, "the adapters must change the tokens for this test to mean much"
    assert [o.lora_request for o in llm.generate([PROMPT], GREEDY, lora_request=requests[1])] == [requests[1]]
    llm.shutdown()


def test_adapters_that_leave_a_layer_alone_batched_together(bundled, tmp_path):
    """Two adapters on q_proj only, batched with the base model: every other layer has no adapter
    of the step (their rows go through untouched); each request still gets PEFT's tokens."""
    from transformers import AutoModelForCausalLM
    paths = [make_adapter(bundled, tmp_path / f"q{i}", r=8, alpha=16, seed=10 + i, scale=1.0, targets=["q_proj"])
             for i in range(2)]
    llm = engine()
    requests = [None, LoRARequest("q0", 1, str(paths[0])), LoRARequest("q1", 2, str(paths[1]))]
    got = run(llm, requests)
    llm.shutdown()
    refs = [AutoModelForCausalLM.from_pretrained(str(bundled), dtype=torch.float32).eval()]
    refs += [peft_model(bundled, p) for p in paths]
    for (tokens, logprobs), ref in zip(got, refs):
        assert tokens == reference_greedy(ref, PROMPT, len(tokens))
        assert max(abs(a - b) for a, b in zip(logprobs, reference_logprobs(ref, PROMPT, tokens))) < 1e-4


def test_more_adapters_than_slots_queue_and_are_dropped_and_loaded_again(adapters):
    """max_loras=1, max_cpu_loras=2, three adapters interleaved over six requests: each request
    still gets what its adapter gives alone, and at most two adapters stay loaded."""
    names = ["all", "rs", "mlp"]
    requests = [LoRARequest(n, i + 1, str(adapters[n])) for i, n in enumerate(names)]
    alone = {}
    with_all = engine()
    for r in requests:
        alone[r.lora_int_id] = run(with_all, [r])[0][0]
    with_all.shutdown()
    llm = engine(max_loras=1, max_cpu_loras=2)
    mixed = requests + requests[::-1]
    got = run(llm, mixed)
    assert [t for t, _ in got] == [alone[r.lora_int_id] for r in mixed]
    assert len(llm.llm_engine.list_loras()) <= 2
    assert run(llm, [requests[0]])[0][0] == alone[1]  # the one dropped last is loaded again
    llm.shutdown()


@dataclass
class TensorLoRARequest(LoRARequest):
    """verl's subclass: the adapter travels with the request."""

    peft_config: dict = field(default=None)
    lora_tensors: dict = field(default=None)


def test_load_inplace_replaces_an_adapter_from_files_or_tensors_and_its_cached_prefixes(adapters):
    """The same id loaded again with load_inplace=True: the next generate runs the new weights
    (from a directory, then from a trainer's tensors), and the prompt's prefix cached under the
    old weights is not reused."""
    fresh = engine()
    expect = {n: run(fresh, [LoRARequest(n, i, str(adapters[n]))])[0][0] for i, n in ((1, "all"), (2, "rs"))}
    assert expect["all"] != expect["rs"]
    fresh.shutdown()
    llm = engine()
    assert llm.llm_engine.add_lora(LoRARequest("policy", 7, str(adapters["all"])))
    policy = LoRARequest("policy", 7, str(adapters["all"]))
    assert run(llm, [policy])[0][0] == expect["all"]
    assert llm.llm_engine.add_lora(LoRARequest("policy", 7, str(adapters["rs"]), load_inplace=True))
    assert run(llm, [policy])[0][0] == expect["rs"]
    config, tensors = adapter_tensors(adapters["all"])
    pushed = TensorLoRARequest("policy", 7, "in-memory", load_inplace=True, peft_config=config, lora_tensors=tensors)
    assert llm.llm_engine.add_lora(pushed)
    assert run(llm, [policy])[0][0] == expect["all"]
    assert llm.llm_engine.list_loras() == {7}
    llm.shutdown()


def test_a_cached_prefix_is_found_only_under_its_own_adapter(adapters, monkeypatch):
    """The prompt's blocks cached by adapter A, then the same prompt with adapter B and with the
    base model: each equals what it gives on a fresh engine. Negative control: with the
    adapter left out of the block hash, B reuses A's KV and the check fails."""
    a = LoRARequest("all", 1, str(adapters["all"]))
    b = LoRARequest("rs", 2, str(adapters["rs"]))

    def isolation_holds() -> bool:
        fresh = {}
        for r in (b, None):
            llm = engine()
            fresh[r] = run(llm, [r])[0]
            llm.shutdown()
        llm = engine()
        run(llm, [a])
        after = {r: run(llm, [r])[0] for r in (b, None)}
        hits = llm.llm_engine.engine_core.scheduler.stats["prefix_hits_tokens"]
        llm.shutdown()
        return after == fresh, hits

    holds, hits = isolation_holds()
    assert holds
    monkeypatch.setattr(LoRAAdapters, "cache_root", lambda self, lora_id: None)
    broken, broken_hits = isolation_holds()
    assert broken_hits > hits and not broken, "the control must reuse the other adapter's blocks and differ"


def _bad(tmp_path, source, edit_config=None, edit_tensors=None):
    bad = tmp_path / "bad"
    shutil.copytree(source, bad)
    if edit_config is not None:
        config = json.loads((bad / "adapter_config.json").read_text())
        edit_config(config)
        (bad / "adapter_config.json").write_text(json.dumps(config))
    if edit_tensors is not None:
        from safetensors.torch import load_file, save_file
        tensors = load_file(str(bad / "adapter_model.safetensors"))
        save_file(edit_tensors(tensors), str(bad / "adapter_model.safetensors"))
    return str(bad)


def _renamed(tensors, old, new):
    return {k.replace(old, new): v for k, v in tensors.items()}


BAD_ADAPTERS = {
    "rank above max_lora_rank": (dict(edit_config=lambda c: c.update(r=32)), "greater than max_lora_rank"),
    "DoRA": (dict(edit_config=lambda c: c.update(use_dora=True)), "DoRA"),
    "modules_to_save": (dict(edit_config=lambda c: c.update(modules_to_save=["lm_head"])), "modules_to_save"),
    "unknown target module": (dict(edit_tensors=lambda t: _renamed(t, "self_attn.q_proj", "self_attn.qq_proj")),
                              "unknown target module"),
    "another model's shapes": (dict(edit_tensors=lambda t: {k: v[:, :64].contiguous() if "lora_A" in k else v
                                                            for k, v in t.items()}), "this base model needs"),
    "a missing B": (dict(edit_tensors=lambda t: {k: v for k, v in t.items() if "0.self_attn.q_proj.lora_B" not in k}),
                    "no lora_B"),
}


@pytest.mark.parametrize("case", sorted(BAD_ADAPTERS))
def test_a_bad_adapter_fails_its_call_in_one_line_and_the_engine_serves_on(case, adapters, tmp_path):
    edits, reason = BAD_ADAPTERS[case]
    path = _bad(tmp_path, adapters["all"], **edits)
    llm = engine()
    good = LoRARequest("good", 1, str(adapters["all"]))
    before = run(llm, [good, None])
    with pytest.raises(LoRAAdapterError, match=reason) as info:
        llm.generate([PROMPT], GREEDY, lora_request=LoRARequest("broken", 2, path))
    assert "'broken'" in str(info.value) and "\n" not in str(info.value)
    after = run(llm, [good, None])  # (a prefix-cache hit now: the same tokens, logprobs to rounding)
    assert [t for t, _ in after] == [t for t, _ in before]
    assert all(abs(x - y) < 1e-4 for (_, a), (_, b) in zip(after, before) for x, y in zip(a, b))
    assert 2 not in llm.llm_engine.list_loras()
    llm.shutdown()


def test_missing_files_a_reused_name_and_lora_off_are_clear_errors(adapters, tmp_path):
    llm = engine()
    for path, reason in ((tmp_path / "nowhere", "no adapter directory"), (tmp_path, "adapter_config.json is missing")):
        with pytest.raises(LoRAAdapterError, match=reason):
            llm.llm_engine.add_lora(LoRARequest("x", 3, str(path)))
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAAdapterError, match="not readable JSON"):
        llm.llm_engine.add_lora(LoRARequest("x", 3, str(tmp_path)))
    llm.llm_engine.add_lora(LoRARequest("policy", 1, str(adapters["all"])))
    with pytest.raises(LoRAAdapterError, match="already loaded with lora_int_id 1"):
        llm.llm_engine.add_lora(LoRARequest("policy", 2, str(adapters["rs"])))
    with pytest.raises(LoRAAdapterError, match="lora_int_id 1 is loaded as 'policy'"):
        llm.generate([PROMPT], GREEDY, lora_request=LoRARequest("other", 1, str(adapters["rs"])))
    with pytest.raises(ValueError, match="id must be > 0"):
        LoRARequest("zero", 0, "x")
    with pytest.raises(TypeError, match="must be a LoRARequest"):
        llm.generate([PROMPT], GREEDY, lora_request="policy")
    assert llm.llm_engine.remove_lora(1) and not llm.llm_engine.remove_lora(1)
    llm.shutdown()
    plain = LLM(dtype="float32", enforce_eager=True)
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate([PROMPT], GREEDY, lora_request=LoRARequest("policy", 1, str(adapters["all"])))
    plain.shutdown()


def test_batch_invariant_mode_gives_an_adapter_the_same_bits_alone_and_batched(adapters):
    """In batch-invariant mode a request of adapter X: tokens and logprobs bit for bit the same
    alone and batched with the base model and two other adapters (sampled at temperature 1)."""
    x = LoRARequest("all", 1, str(adapters["all"]))
    others = [None, LoRARequest("rs", 2, str(adapters["rs"])), LoRARequest("mlp", 3, str(adapters["mlp"]))]
    sampled = SamplingParams(temperature=1.0, seed=11, max_tokens=8, logprobs=3, ignore_eos=True)
    llm = engine(batch_invariant=True)
    alone = run(llm, [x], params=sampled)[0]
    prompts = [PROMPT[:20], PROMPT, PROMPT[:9] + [65, 66], PROMPT]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampled, lora_request=[others[0], x] + others[1:])
    c = outs[1].outputs[0]
    assert (list(c.token_ids), [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]) == alone
    llm.shutdown()


def test_adapters_survive_sleep_and_wake(adapters):
    llm = engine(enable_sleep_mode=True)
    a = LoRARequest("all", 1, str(adapters["all"]))
    before = run(llm, [a, None])
    for level in (1, 2):
        llm.sleep(level=level)
        llm.wake_up()
        if level == 2:
            llm.collective_rpc("reload_weights")
        assert [t for t, _ in run(llm, [a, None])] == [t for t, _ in before]
        assert llm.llm_engine.list_loras() == {1}
    llm.shutdown()


@pytest.mark.slow
def test_the_compiled_forward_serves_adapters_as_eager_does(adapters):
    """bf16, the compiled forward (LoRA products as one opaque op in each graph, the graphs
    shared by every chunk): the same tokens as the same engine eager, for a mixed batch and
    one adapter alone; and an engine without LoRA does not take its graphs (they differ)."""
    requests = [None, LoRARequest("all", 1, str(adapters["all"])), LoRARequest("rs", 2, str(adapters["rs"]))]
    got = {}
    for eager in (True, False):
        llm = engine(dtype="bfloat16", enforce_eager=eager)
        got[eager] = ([t for t, _ in run(llm, requests)], run(llm, [requests[1]])[0][0])
        if not eager:
            assert llm.llm_engine.engine_core.executor.collective_rpc("get_runner_stats")[0]["compiled_graphs"] > 0
        llm.shutdown()
    assert got[False] == got[True]


@pytest.mark.slow
def test_attention_lora_on_a_mixture_of_experts_model_and_expert_lora_refused(tmp_path):
    """Qwen3-MoE (q/k norm, sparse MLPs, one dense layer): an adapter on the attention projections
    gives PEFT's tokens and logprobs, at uni and TP 2 (mp); an adapter on an MoE block's MLP is
    refused by name."""
    from make_random_checkpoint import make_random_checkpoint
    model = make_random_checkpoint(tmp_path / "moe", architecture="Qwen3MoeForCausalLM", hidden_size=64, num_layers=3,
                                   num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96, vocab_size=200,
                                   num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1], seed=5)
    adapter = make_adapter(model, tmp_path / "attn", r=8, alpha=16, seed=4, scale=0.8,
                           targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    ref = peft_model(model, adapter)
    prompt = [3 + (11 * i) % 190 for i in range(20)]
    request = LoRARequest("attn", 1, str(adapter))
    for layout in ({}, {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}):
        llm = engine(model=str(model), **layout)
        (tokens, logprobs), (base, _) = run(llm, [request, None], prompt=prompt)
        assert tokens == reference_greedy(ref, prompt, len(tokens)) and tokens != base, layout
        assert max(abs(a - b) for a, b in zip(logprobs, reference_logprobs(ref, prompt, tokens))) < 1e-4
        llm.shutdown()
    experts = make_adapter(model, tmp_path / "mlp", r=4, alpha=4, seed=6, targets=["gate_proj", "up_proj"])
    on_block = _bad(tmp_path, adapter, edit_tensors=lambda t: _renamed(t, "layers.0.self_attn.q_proj",
                                                                         "layers.0.mlp.gate_proj"))
    llm = engine(model=str(model))
    with pytest.raises(LoRAAdapterError, match=r"'experts': .*target_parameters \(expert LoRA\) not supported"):
        llm.llm_engine.add_lora(LoRARequest("experts", 2, str(experts)))  # PEFT's own expert adapter
    with pytest.raises(LoRAAdapterError, match="LoRA on a mixture-of-experts block is not supported"):
        llm.llm_engine.add_lora(LoRARequest("on-block", 3, on_block))
    llm.shutdown()
