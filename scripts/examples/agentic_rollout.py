"""Agentic multi-turn rollouts under SPMD, driven step by step through `llm.llm_engine`.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 scripts/examples/agentic_rollout.py --out rollouts.jsonl

Four ranks, two TP=2 replicas (external DP). In each replica only the first rank talks to
the "environment" (LLM(admission="rank0")): it starts episodes, feeds each completion to a
tiny deterministic tool (it counts the vowels of the completion and answers with the
count), and continues the conversation as a new request whose prompt is the whole
transcript, so the prefix cache computes only the new tokens (`num_cached_tokens`). The
other rank only steps. New episodes start while others are in flight. Half-way through,
one weight update: pause_generation(mode="keep"), load the new weights, reset the running
requests' KV, resume; every turn records the weight version it finished under. Each
replica's first rank writes its episodes to `<out>.replica<k>` and rank 0 merges them.
"""

from __future__ import annotations

import argparse
import json
import os

import torch.distributed as dist
from safetensors.torch import load_file

from spmd_engine import LLM, SamplingParams
from spmd_engine.config import ModelConfig


def tool(text: str) -> str:
    return f"\n[tool] {sum(ch in 'aeiou' for ch in text)} vowels.\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="rollouts.jsonl")
    parser.add_argument("--episodes", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=12)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    llm = LLM(tensor_parallel_size=2, distributed_executor_backend="external_launcher", seed=0, admission="rank0")
    engine, replica = llm.llm_engine, llm.replica_index
    openers = ["Beautiful is", "Errors should", "Simple is", "Now is", "Flat is", "Sparse is"]
    episodes = {e: {"episode": f"r{replica}e{e}", "prompt": openers[(e + replica) % len(openers)], "turns": []}
                for e in range(args.episodes)}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=replica)
    update_at, updated, step = 2 * args.max_tokens, False, 0  # after some turns finished, before others
    started = 0
    while True:
        if engine.takes_input and started < args.episodes and step % 3 == 0:  # new episodes arrive mid-run
            episode = episodes[started]
            engine.add_request(f"{started}/0", episode["prompt"], params)
            started += 1
        if step == update_at and not updated:  # every rank of the replica calls these together
            llm.pause_generation(mode="keep")
            llm.start_weight_update()
            state_dict = load_file(ModelConfig().model_dir + "/model.safetensors")  # the trainer's new policy
            llm.collective_rpc("load_weights", args=(list(state_dict.items()),))
            llm.finish_weight_update(1)
            llm.reset_prefix_cache(reset_running_requests=True)  # running requests recompute their KV
            llm.resume_generation()
            updated = True
        for out in engine.step():
            if not out.finished:
                continue
            e, turn = map(int, out.request_id.split("/"))
            episode, text = episodes[e], out.outputs[0].text
            episode["turns"].append({"turn": turn, "completion": text, "num_cached_tokens": out.num_cached_tokens,
                                     "prompt_tokens": len(out.prompt_token_ids), "weight_version": out.weight_version})
            episode["prompt"] += text + tool(text)
            if engine.takes_input and turn + 1 < args.turns:
                engine.add_request(f"{e}/{turn + 1}", episode["prompt"], params)
        step += 1
        arrivals_left = step <= 3 * (args.episodes - 1) or step <= update_at  # the same on every rank
        if not arrivals_left and not engine.has_unfinished_requests():
            break
    if engine.takes_input:
        with open(f"{args.out}.replica{replica}", "w") as f:
            for episode in episodes.values():
                transcript = episode.pop("prompt")
                f.write(json.dumps({"replica": replica, **episode, "transcript": transcript}) + "\n")
    dist.barrier()
    llm.shutdown()
    if dist.get_rank() == 0:
        parts = sorted(p for p in os.listdir(os.path.dirname(os.path.abspath(args.out)))
                       if p.startswith(os.path.basename(args.out) + ".replica"))
        folder = os.path.dirname(os.path.abspath(args.out))
        with open(args.out, "w") as merged:
            for part in parts:
                with open(os.path.join(folder, part)) as f:
                    merged.write(f.read())
                os.remove(os.path.join(folder, part))
        for line in open(args.out):
            ep = json.loads(line)
            print(ep["episode"], [(t["turn"], t["num_cached_tokens"], t["weight_version"]) for t in ep["turns"]])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
