"""Six open-source clients of vLLM, replayed call for call against this engine.

Each replay makes the calls its client makes on vLLM, with the same arguments and in the same
order, written here from a reading of the client's source (never copied):

- torchtitan's RL generator (torchtitan/experiments/rl/actors/generator.py, Aug 2026):
  `LLMEngine.from_engine_args(EngineArgs(...))`, rank 0 deciding each loop action and
  broadcasting it over a gloo group, `add_request` with per-sample seeds and FINAL_ONLY
  outputs, bursts of `step()` while `has_unfinished_requests()`, and a weight pull through
  `model_executor.driver_worker.get_model()`'s state dict (filled in place, then
  `load_state_dict(strict=False)`) followed by `reset_prefix_cache(reset_running_requests=True)`.
- verl's last SPMD rollout (verl/workers/rollout/vllm_rollout/vllm_rollout_spmd.py and
  verl/workers/fsdp_workers.py before PR #4411 retired it): `LLM(load_format="dummy", ...)`,
  trainer mode at start (`reset_prefix_cache`, `sleep(level=2)`), then per step
  `wake_up(tags=["weights"])`, `...driver_worker.worker.model_runner.model.load_weights(gen)`,
  `wake_up(tags=["kv_cache"])`, `generate`, `reset_prefix_cache`, `sleep(2)`; its validation
  pass makes the shared SamplingParams greedy by setting attributes on it.
- ms-swift's GRPO colocate mode (swift/rlhf_trainers/rollout_mixin.py with
  swift/infer_engine/vllm_engine.py and grpo_vllm_engine.py): an LLMEngine built from
  EngineArgs, `reset_mm_cache`, `sleep(level)`, per step a wake by tags around
  `load_weights`, `reset_prefix_cache` / `reset_encoder_cache`, requests gathered in the TP
  group with per-request seeds, stop words set on the SamplingParams after it is made,
  `add_request` then `step()` until done, `reset_prefix_cache`, `sleep(level)`.
- ms-swift's batch inference under torchrun (swift/pipelines/infer/infer.py): engine seed
  `seed + rank // tp`, the dataset sharded contiguously over the replicas, results gathered
  (JsonlWriter(gather_obj=True)) and written by rank 0.
- lm-evaluation-harness's vLLM backend (lm_eval/models/vllm_causallms.py, with the torchrun
  arguments of its PR #3304): `LLM(**model_args)`, loglikelihood from `prompt_logprobs=1`
  and generate_until with stop strings, requests reordered by its Collator.
- AgileRL's LoRA colocate mode (agilerl/algorithms/core/llm_vllm.py): `LLM(enable_lora=True,
  ...)` under torchrun, per step `wake_up()`, the PEFT adapter saved and
  `llm_engine.add_lora(LoRARequest(..., load_inplace=True))`, `reset_prefix_cache()`, the TP
  group's prompts gathered and generated with `lora_request`, `sleep(level=1)`.

What a client does through vLLM internals that have no counterpart here is left out and
named where it would be (verl's and ms-swift's `process_weights_after_loading`, torchtitan's
registered model class, worker class and attention config). A call the engine lacks is
recorded in the report's "gaps" (with the error it raised) and replaced by the nearest call
that exists, so the rest of the replay still runs; the tests treat every gap as a failure to
fix in the engine (tests/integration/rl/test_vllm_clients.py).

    torchrun --nproc-per-node 2 vllm_clients.py CONFIG.json    (TP 2 / DP 2, external_launcher)
One REPORT line per client per rank (with "error", its traceback, when the replay raised: every
rank raises alike, and the launch goes on with the next client). The tests also call `run_client(name, config, "uni")` in
their own process.
`VLLM_CLIENTS_BREAK=torchtitan,verl,swift_grpo` skips those clients' weight pushes, and
`verl_stale` pushes the first step's weights at every verl step (negative controls, run by hand:
those tests must then fail).

The replays live in tests/helpers/vllm_replays/, one module per client; this script picks them
by name, runs them in its rank and prints their reports.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch.distributed as dist

HELPERS = str(Path(__file__).resolve().parent.parent)  # tests/helpers: torchrun puts only this folder on the path
if HELPERS not in sys.path:
    sys.path.insert(0, HELPERS)

from vllm_replays.agilerl import agilerl  # noqa: E402
from vllm_replays.common import Launch, collect  # noqa: E402
from vllm_replays.lm_eval import lm_eval  # noqa: E402
from vllm_replays.swift_batch_infer import swift_batch_infer  # noqa: E402
from vllm_replays.swift_grpo import swift_grpo  # noqa: E402
from vllm_replays.torchtitan import torchtitan  # noqa: E402
from vllm_replays.verl import verl  # noqa: E402

CLIENTS = {"torchtitan": torchtitan, "verl": verl, "swift_grpo": swift_grpo, "swift_infer": swift_batch_infer,
           "lm_eval": lm_eval, "agilerl": agilerl}
# Clients whose trainer makes the torch world before the engine (accelerate, verl's workers).
IN_TRAINERS_WORLD = ("verl", "swift_grpo", "agilerl")


def run_client(name: str, cfg: dict, backend: str = "uni") -> dict:
    """One client's replay in this process (backend "uni"), or in this torchrun rank."""
    launch = Launch(backend) if backend == "uni" else Launch(backend, int(os.environ["RANK"]),
                                                              int(os.environ["WORLD_SIZE"]))
    try:
        report = CLIENTS[name](cfg, launch)
    except Exception as exc:  # the same on every rank: each reports it and goes on to the next client
        error = "".join(traceback.format_exception(exc))
        traceback.clear_frames(exc.__traceback__)  # the failed replay's engine must not outlive it
        del exc
        collect()
        return {"client": name, "rank": launch.rank, "error": error}
    return {"client": name, "rank": launch.rank, **report}


def main() -> None:
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    names = sys.argv[2:] or list(CLIENTS)
    # The clients whose engine makes the world first, then those run in a trainer's world
    # (made once, as one trainer process would, and torn down by it at the end).
    for name in [n for n in names if n not in IN_TRAINERS_WORLD]:
        emit(run_client(name, cfg, "external_launcher"))
    trainers = [n for n in names if n in IN_TRAINERS_WORLD]
    if trainers:
        dist.init_process_group("gloo")
        for name in trainers:
            emit(run_client(name, cfg, "external_launcher"))
        dist.barrier()
        dist.destroy_process_group()


def emit(report: dict) -> None:
    sys.stdout.write("REPORT " + json.dumps(report) + "\n")  # one write: whole lines do not interleave
    sys.stdout.flush()


if __name__ == "__main__":
    main()
