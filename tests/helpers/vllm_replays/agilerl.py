"""AgileRL's LoRA colocate mode (agilerl/algorithms/core/llm_vllm.py with llm_utils.py's
build_vllm_llm_init_kwargs / build_vllm_rollout_lora_request, 2026): vLLM under torchrun
(external_launcher, seed process_index // tp, enable_lora, sleep mode), its own base; per step
the trainer's PEFT adapter saved to a rank-private staging directory, the engine woken,
`llm_engine.add_lora(LoRARequest("actor", 1, path, load_inplace=<loaded before>))` (its return
value checked), `reset_prefix_cache()`, the TP group's prompts gathered (all_gather_object) and
generated with `lora_request` (load_inplace False: "the request handed to generate() must NOT
carry load_inplace"), then the engine put back to sleep for the training step.

The trainer's step is stood in for by a seeded change of the adapter's A and B (PEFT's own model
on transformers, saved by PEFT's save_pretrained); the test checks every step's sampled tokens'
logprobs against PEFT with that step's adapter.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from vllm_replays.common import BREAK, Gaps, Launch, collect

AGILERL = {"tp": 2, "lora_rank": 8, "lora_alpha": 16, "max_loras": 1, "max_lora_rank": 16, "steps": 3,
           "max_output_tokens": 6, "temperature": 0.9, "top_p": 1.0, "repetition_penalty": 1.0,
           "group_size": 2, "max_model_len": 48}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def trainer_adapter(path: str):
    """The trainer's PEFT model (LoRA on every target; B random rather than zero, so the first
    adapter already differs from the base model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    args = AGILERL
    torch.manual_seed(0)  # PEFT draws A's start: every rank's trainer the same, as DDP makes them
    model = get_peft_model(base, LoraConfig(r=args["lora_rank"], lora_alpha=args["lora_alpha"], lora_dropout=0.0,
                                            target_modules=TARGETS, task_type="CAUSAL_LM"))
    return model


def train_step(model, step: int) -> None:
    """Stands in for the optimizer step: every A and B moved by a seeded amount (the same on every
    rank, as DDP keeps the trainers' adapters equal)."""
    g = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn(param.shape, generator=g) * 0.3 / param.shape[-1] ** 0.5)


def agilerl(cfg: dict, launch: Launch) -> dict:
    from spmd_engine import LLM, SamplingParams
    from spmd_engine.lora_request import LoRARequest
    gaps = Gaps()
    args = AGILERL
    tp = args["tp"] if launch.external else 1
    tp_group = None
    if tp > 1:
        tp_group, _ = dist.new_subgroups_by_enumeration(
            [list(range(i * tp, (i + 1) * tp)) for i in range(launch.world // tp)])
    llm = LLM(model=cfg["orig"], tensor_parallel_size=tp, gpu_memory_utilization=0.5, max_num_seqs=8,
              max_model_len=args["max_model_len"], distributed_executor_backend=launch.backend,
              seed=launch.rank // tp, max_num_batched_tokens=max(args["max_model_len"], 8 * 8192),
              enable_sleep_mode=True, enable_lora=True, max_lora_rank=args["max_lora_rank"],
              max_loras=args["max_loras"], dtype="float32")
    model = trainer_adapter(cfg["orig"])
    staging = os.path.join(cfg["out_dir"], f"agilerl_{launch.backend}", f"rank_{launch.rank}")
    loaded, steps = False, []
    mine = [cfg["prompts"][(launch.rank + k) % len(cfg["prompts"])] for k in range(2)]
    llm.sleep(level=1)  # the trainer's memory until the first rollout
    for step in range(args["steps"]):
        train_step(model, step)
        llm.wake_up()
        path = os.path.join(staging, f"step{step}")  # save_peft_adapter_for_vllm_rollout
        model.save_pretrained(path, safe_serialization=True)
        if launch.external:
            dist.barrier()  # accelerator.wait_for_everyone()
        if "agilerl" not in BREAK or not loaded:
            ok = llm.llm_engine.add_lora(LoRARequest("actor", 1, path, load_inplace=loaded))
            if not ok:
                raise RuntimeError(f"vLLM failed to load LoRA adapter from {path}")
        loaded = True
        llm.reset_prefix_cache()
        prompts = [p for p in mine for _ in range(args["group_size"])]
        if tp_group is not None:  # the TP group's prompts gathered: every rank of it asks the same
            gathered = [None] * tp
            dist.all_gather_object(gathered, prompts, group=tp_group)
            prompts = [p for part in gathered for p in part]
        params = [SamplingParams(n=1, repetition_penalty=args["repetition_penalty"], temperature=args["temperature"],
                                 top_p=args["top_p"], top_k=-1, min_p=0.0, min_tokens=0, presence_penalty=0.0,
                                 frequency_penalty=0.0, logprobs=0, max_tokens=args["max_output_tokens"])
                  for _ in prompts]
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sampling_params=params,
                            use_tqdm=False, lora_request=LoRARequest("actor", 1, path, load_inplace=False))
        steps.append({"adapter": path, "samples": [
            {"prompt": list(o.prompt_token_ids), "tokens": list(o.outputs[0].token_ids),
             "logprobs": [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]}
            for o in outs]})
        llm.sleep(level=1)
    del llm  # AgileRL's clean_up drops the engine
    collect()
    return {"steps": steps, "gaps": gaps.found}
