"""What each rank of a real launch loads: its model's parameter and buffer bytes, and its KV blocks.

Every case of CASES_JSON builds an `LLM` (external_launcher: this process is one rank)
in turn, so one torchrun launch measures several layouts; each rank writes
OUT_DIR/rank{R}.json with {case name: {"weight_bytes", "kv_blocks"}}. The reference for
`plan`'s memory numbers (tests/e2e/test_plan_memory.py).

    torchrun --nproc-per-node 4 rank_memory.py CASES_JSON OUT_DIR
"""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from spmd_engine import LLM
from spmd_engine.envs import PP_PARTITION


def loaded_bytes(model) -> int:
    """Every tensor the rank holds once (a tied head is the embedding)."""
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


if __name__ == "__main__":
    cases = json.loads(Path(sys.argv[1]).read_text())
    measured = {}
    for case in cases:
        os.environ.pop(PP_PARTITION, None)
        os.environ.update(case.get("env", {}))
        with LLM(model=case["model"], distributed_executor_backend="external_launcher", seed=0,
                 **case["llm"]) as llm:
            runner = llm.llm_engine.model_executor.driver_worker.model_runner
            measured[case["name"]] = {"weight_bytes": loaded_bytes(runner.model), "kv_blocks": runner.num_blocks}
            rank = dist.get_rank()
    (Path(sys.argv[2]) / f"rank{rank}.json").write_text(json.dumps(measured))
    sys.exit(0)
