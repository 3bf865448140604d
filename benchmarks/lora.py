"""Figure lora: decode at B=8 with every request on one LoRA adapter, and with four adapters
mixed in the batch, against the same requests on the base model, one engine, in turns."""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.harness import LLAMA_SHAPE, emit, loadavg, prompts_for, random_llama

RANK = 16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_adapter(seed: int) -> tuple[dict, dict]:
    """(peft_config, tensors) of a rank-16 adapter on every target of the bench Llama, random A
    and B: the in-memory form a trainer pushes."""
    h, inter = LLAMA_SHAPE["hidden_size"], LLAMA_SHAPE["intermediate_size"]
    kv = h // LLAMA_SHAPE["num_heads"] * LLAMA_SHAPE["num_kv_heads"]
    shapes = {"q_proj": (h, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, h),
              "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(LLAMA_SHAPE["num_layers"]):
        for module in TARGETS:
            out_features, in_features = shapes[module]
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            name = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(RANK, in_features, generator=gen) * 0.02
            tensors[f"{name}.lora_B.weight"] = torch.randn(out_features, RANK, generator=gen) * 0.02
    return {"r": RANK, "lora_alpha": 2 * RANK, "target_modules": list(TARGETS)}, tensors


def fig_lora(args) -> None:
    from dataclasses import dataclass, field

    from spmd_engine import LLM, SamplingParams
    from spmd_engine.lora_request import LoRARequest

    @dataclass
    class TensorLoRARequest(LoRARequest):
        peft_config: dict = field(default=None)
        lora_tensors: dict = field(default=None)

    batch, new = 8, 16 if args.quick else 64
    prompts = prompts_for(batch, 32, LLAMA_SHAPE["vocab_size"])
    with LLM(model=random_llama(args), dtype="bfloat16", max_num_seqs=batch, distributed_executor_backend="uni",
             enable_lora=True, max_loras=4, max_lora_rank=RANK) as llm:
        adapters = []
        for i in range(4):
            config, tensors = random_adapter(i)
            llm.llm_engine.add_lora(TensorLoRARequest(f"a{i}", i + 1, "bench", peft_config=config, lora_tensors=tensors))
            adapters.append(LoRARequest(f"a{i}", i + 1, "bench"))
        kinds = {"base": [None] * batch, "one": [adapters[0]] * batch, "four": [adapters[i % 4] for i in range(batch)]}
        sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        rates = {kind: [] for kind in kinds}
        for _ in range(args.reps + 1):  # the first round warms every kind
            for kind, loras in kinds.items():
                t0 = time.perf_counter()
                outs = llm.generate(prompts, sp, lora_request=loras)
                assert all(len(o.outputs[0].token_ids) == new for o in outs)
                rates[kind].append(batch * new / (time.perf_counter() - t0))
    base = statistics.median(rates["base"][1:])
    for kind, target in (("one", 0.7), ("four", 0.6)):
        v = statistics.median(rates[kind][1:])
        emit(f"lora_{kind}_adapter{'s' if kind == 'four' else ''}_decode_tokens_per_s_b8", v, base, v / base,
             "tokens/s", ratio_is="value/baseline, higher is better (target >= %.1f)" % target,
             value_is=f"B=8 decode, {'every request on one' if kind == 'one' else 'two requests on each of four'} "
                      f"rank-{RANK} adapter(s) on all 7 targets",
             baseline_is="the same requests on the base model, same engine, in turns", dtype="bfloat16",
             new_tokens=new, reps=args.reps, loadavg_1m=loadavg())
