#!/usr/bin/env python
"""Colocated GRPO on the bundled model: trainer and rollout engine share every torchrun rank.

    torchrun --nproc-per-node 4 scripts/examples/rl_colocate.py [--steps 10]

The 4 ranks are the trainer's data-parallel world (torch DDP over gloo) and, inside the same
world, two TP=2 rollout replicas (`distributed_executor_backend="external_launcher"`): ranks
{0,1} are replica 0, {2,3} replica 1. Each step:

1. every replica samples `n` completions for its own prompts (both ranks of a replica pass the
   same prompts and seeds, so they generate the same tokens), with the sampled tokens' logprobs;
2. reward = how often a letter occurs in the completion; advantages are normalised within each
   prompt's group of n samples (GRPO);
3. the engine sleeps; each rank trains on its half of its replica's samples: the trainer
   recomputes the sampled tokens' logprobs with its own model (printed: their largest
   difference from the engine's, a check that both run the same weights), and DDP averages the
   policy-gradient step over the 4 ranks;
4. the engine wakes, takes the trainer's new weights in place (`load_weights` with HF names,
   full tensors) and resets its prefix cache, so the next rollouts come from the new policy.

Why DDP and not FSDP2: the model has 1.2M parameters, so sharding it saves nothing, and DDP's
`state_dict()` is already full tensors under HF names, the form `load_weights` takes (an FSDP2
model would hand DTensors, which `load_weights` gathers with `full_tensor()`; that works too).

With `--lora R` the trainer trains a rank-R LoRA adapter instead of the weights (the base stays
frozen on both sides) and pushes it as tensors every step: `llm_engine.add_lora` with
`load_inplace=True`, the request shape verl sends (`peft_config` and `lora_tensors`), and the
rollouts name it with `lora_request`. The trainer's adapter is PEFT's on transformers' model, or
with `--batch-invariant` the engine's own LoRA layers (spmd_engine.model.lora.trainable).

The reward curve must come from the weight updates reaching the engine: `--no-weight-sync`
skips `load_weights`, and then the reward stays flat while the logprob difference grows.
Deterministic: fixed seeds for the trainer, the engine and every request; OMP_NUM_THREADS=1.
The trainer's model is transformers' LlamaForCausalLM (`pip install transformers`).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

# Prompts the bundled model (which memorised the Zen of Python) has never seen: its samples vary,
# so rewards differ within a group and the policy gradient has something to work with.
PROMPTS = ["Hello", "The cat", "xq", "zzz", "1234", "Once upon", "foo bar", "Q:"]
TP = 2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prompts-per-replica", type=int, default=4)
    p.add_argument("--samples", type=int, default=4, help="samples per prompt (the GRPO group)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--letter", default="e", help="the reward counts this letter in the completion")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-weight-sync", action="store_true",
                   help="negative control: never push the trainer's weights to the engine")
    p.add_argument("--batch-invariant", action="store_true",
                   help="the engine in batch-invariant mode and, as trainer, the engine's own model "
                        "(spmd_engine.model.trainer): trainer and engine logprobs equal bit for bit")
    p.add_argument("--lora", type=int, default=0, metavar="R",
                   help="train a rank-R LoRA adapter and push it (as tensors) instead of the weights")
    return p.parse_args(argv)


def rollout(llm, prompts: list[str], args, step: int, first_index: int):
    """n samples per prompt; each prompt has its own seed (sample k draws from seed + k)."""
    from spmd_engine import SamplingParams
    from spmd_engine.lora_request import LoRARequest
    params = [SamplingParams(n=args.samples, temperature=1.0, logprobs=0, max_tokens=args.max_tokens,
                             seed=((args.seed * 1000 + step) * len(PROMPTS) + first_index + i) * args.samples)
              for i in range(len(prompts))]
    return llm.generate(prompts, params, lora_request=LoRARequest("policy", 1, "trainer") if args.lora else None)


def lora_push(trainer, load_inplace: bool):
    """The trainer's adapter as verl sends it: a LoRARequest carrying its config and tensors."""
    from spmd_engine.lora_request import LoRARequest

    @dataclass
    class TensorLoRARequest(LoRARequest):
        peft_config: dict = field(default=None)
        lora_tensors: dict = field(default=None)
    if isinstance(trainer, BatchInvariantTrainer):
        config, tensors = trainer.lora.peft_config(), trainer.lora.peft_tensors()
    else:
        from peft import get_peft_model_state_dict
        peft_model = trainer.module
        config = peft_model.peft_config["default"].to_dict()  # as verl: PEFT's enums and sets included
        tensors = {k: v.detach() for k, v in get_peft_model_state_dict(peft_model).items()}
    return TensorLoRARequest("policy", 1, "trainer", load_inplace=load_inplace, peft_config=config,
                             lora_tensors=tensors)


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """GRPO: each sample's reward against its prompt's group ([prompts, n] -> same shape)."""
    return (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)


def token_logprobs(model, prompt_ids: list[list[int]], completions: list[list[int]]):
    """The trainer's logprob of every sampled token: [samples, longest completion] and its mask."""
    lengths = [len(p) + len(c) for p, c in zip(prompt_ids, completions)]
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompt_ids, completions)):
        ids[i, : lengths[i]] = torch.tensor(p + c)
    logits = model(input_ids=ids[:, :-1]).logits  # right padding: causal attention ignores it
    log_softmax = getattr(model, "log_softmax", lambda x: torch.log_softmax(x, dim=-1))
    all_logprobs = log_softmax(logits.float()).gather(2, ids[:, 1:, None]).squeeze(2)
    width = max(len(c) for c in completions)
    out = torch.zeros(len(lengths), width)
    mask = torch.zeros(len(lengths), width)
    for i, (p, c) in enumerate(zip(prompt_ids, completions)):
        out[i, : len(c)] = all_logprobs[i, len(p) - 1 : len(p) - 1 + len(c)]
        mask[i, : len(c)] = 1
    return out, mask


class BatchInvariantTrainer(torch.nn.Module):
    """The engine's own model as the trainer (spmd_engine.model.trainer): its logprobs take the
    batch-invariant kernels the engine runs in that mode, so they equal the engine's bit for
    bit. Called as transformers' model is here (`input_ids=` -> `.logits`); gradients are
    averaged over the world by hand (DDP would need its own forward)."""

    def __init__(self, path, lora_rank: int = 0):
        super().__init__()
        from spmd_engine.model.trainer import trainer_model
        self.model = trainer_model(path)
        self.lora = None
        if lora_rank:  # the base frozen; the adapter's A and B are what trains
            from spmd_engine.model.lora.trainable import TrainableLoRA
            self.model.requires_grad_(False)
            self.lora = TrainableLoRA(self.model, r=lora_rank, alpha=2 * lora_rank)

    def forward(self, input_ids):
        from contextlib import nullcontext
        from types import SimpleNamespace
        positions = torch.arange(input_ids.shape[1]).expand(input_ids.shape[0], -1)
        with self.lora.active() if self.lora is not None else nullcontext():
            hidden = self.model.forward(input_ids, positions, None)["hidden_states"]
        return SimpleNamespace(logits=self.model.compute_logits(hidden))

    @staticmethod
    def log_softmax(logits):
        from spmd_engine.model.layers import batch_invariant as bi
        return bi.log_softmax(logits)

    def state_dict(self, *args, **kwargs):
        from spmd_engine.model.trainer import hf_named_parameters
        return dict(hf_named_parameters(self.model))

    def average_gradients(self) -> None:
        for param in self.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad)
                param.grad /= dist.get_world_size()


def engine_logprobs(completions, shape) -> torch.Tensor:
    """The engine's logprob of each sampled token (`logprobs=0`), laid out as token_logprobs'."""
    out = torch.zeros(shape)
    for row, c in enumerate(completions):
        out[row, : len(c.token_ids)] = torch.tensor([c.logprobs[t][tok].logprob
                                                     for t, tok in enumerate(c.token_ids)])
    return out


def world_mean(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def world_max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main(argv=None) -> list[float]:
    args = parse_args(argv)
    from transformers import LlamaForCausalLM

    from spmd_engine import LLM
    from spmd_engine.config import ModelConfig

    dist.init_process_group("gloo")  # the trainer's world, before the engine exists
    rank, world = dist.get_rank(), dist.get_world_size()
    replica, tp_rank, replicas = rank // TP, rank % TP, world // TP
    torch.manual_seed(args.seed)
    path = ModelConfig(model=None).model_dir  # the bundled model

    if args.batch_invariant:
        trainer = model = BatchInvariantTrainer(path, args.lora)
    else:
        model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
        if args.lora:
            from peft import LoraConfig, get_peft_model
            model = get_peft_model(model, LoraConfig(r=args.lora, lora_alpha=2 * args.lora, lora_dropout=0.0,
                                                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                     "gate_proj", "up_proj", "down_proj"]))
        trainer = DistributedDataParallel(model)  # CPU + gloo: gradients all-reduced over the 4 ranks
    optimizer = torch.optim.Adam([p for p in trainer.parameters() if p.requires_grad], lr=args.lr)
    llm = LLM(model=path, tensor_parallel_size=TP, distributed_executor_backend="external_launcher",
              seed=args.seed + replica, enable_sleep_mode=True, max_model_len=64,
              batch_invariant=args.batch_invariant, enable_lora=bool(args.lora), max_lora_rank=max(args.lora, 8))
    engine_model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    if args.lora:
        llm.llm_engine.add_lora(lora_push(trainer, load_inplace=False))  # B is zero: the base model

    first = replica * args.prompts_per_replica
    prompts = [PROMPTS[(first + i) % len(PROMPTS)] for i in range(args.prompts_per_replica)]
    curve = []
    for step in range(args.steps):
        outs = rollout(llm, prompts, args, step, first)
        samples = [(o.prompt_token_ids, c) for o in outs for c in o.outputs]
        rewards = torch.tensor([float(c.text.count(args.letter)) for _, c in samples])
        rewards = rewards.view(len(outs), args.samples)
        advantages = group_advantages(rewards).view(-1)
        # Both ranks of a replica hold the same samples: each trains on its half.
        mine = list(range(tp_rank, len(samples), TP))
        llm.sleep(level=1)  # the KV cache's memory is the training step's now

        logprobs, mask = token_logprobs(trainer, [samples[i][0] for i in mine],
                                        [samples[i][1].token_ids for i in mine])
        engine = engine_logprobs([samples[i][1] for i in mine], logprobs.shape)
        diff = ((logprobs.detach() - engine).abs() * mask).max().item()
        per_sample = (logprobs * mask).sum(1) / mask.sum(1)
        loss = -(advantages[mine] * per_sample).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP averages the gradients over every rank's samples
        if args.batch_invariant:
            model.average_gradients()
        optimizer.step()

        llm.wake_up(tags=["weights"])
        if not args.no_weight_sync:
            # A versioned push: no rank serves a half-written policy, and each rollout after it
            # says which policy produced it (RequestOutput.weight_version).
            llm.start_weight_update()
            if args.lora:  # the adapter replaced in place, between two engine steps
                llm.llm_engine.add_lora(lora_push(trainer, load_inplace=True))
            else:
                engine_model.load_weights(model.state_dict().items())  # full tensors, HF names
            llm.finish_weight_update(step + 1)
        llm.wake_up(tags=["kv_cache"])
        llm.reset_prefix_cache()  # cached prefixes hold keys and values of the old weights

        reward = world_mean(rewards.mean().item())  # every replica counted TP times: its mean
        diff = world_max(diff)
        curve.append(round(reward, 4))
        if rank == 0:
            print(f"step {step:2d}  policy {outs[0].weight_version}  mean reward {reward:6.3f}  "
                  f"max |trainer - engine logprob| {diff:.3g}  ({replicas} replicas x {len(samples)} samples)",
                  flush=True)
    if rank == 0:
        print("REWARD_CURVE " + json.dumps(curve), flush=True)
    llm.shutdown()  # the engine's groups only: the trainer's world is still up
    dist.barrier()
    dist.destroy_process_group()
    return curve


if __name__ == "__main__":
    main()
