"""Two jobs of one user on one host at once (issue 25): a torchrun job and an mp job, the same
model, the same output directory with different files. Nothing they make may collide: ports
(each store on a port of its own), /dev/shm names (a random token per segment), part and
temporary files (named after each output file). Both must finish with the right text and
leave nothing behind.
"""

from __future__ import annotations

import json

import pytest
from launch import PYTHON, Launch, base_env, unique_tag
from zen import continuation

PROMPTS = ["Beautiful is", "Explicit is", "Simple is", "Complex is", "Flat is", "Sparse is"]
MAX_TOKENS = 32


@pytest.mark.timeout(300)
def test_a_torchrun_job_and_an_mp_job_at_once_both_finish_right(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(p + "\n" for p in PROMPTS))
    out = {name: tmp_path / f"{name}.jsonl" for name in ("torchrun", "mp")}
    job = ["-m", "spmd_engine.run", "--prompts-file", str(prompts), "--max-tokens", str(MAX_TOKENS),
           "--quiet", "-tp", "2", "--timeout", "120"]
    tag = unique_tag("two-jobs")
    torchrun = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--monitor-interval", "0.2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id", tag,
                *job, "--output", str(out["torchrun"])]
    mp = [PYTHON, *job, "--output", str(out["mp"]), "--distributed-executor-backend", "mp"]
    launch = Launch([torchrun, mp], [base_env(tag)] * 2, tag, timeout=280)
    assert launch.returncodes == [0, 0], launch.describe()
    assert not launch.leftover_pids and not launch.stale_segments(), launch.describe()
    for name, path in out.items():
        texts = [json.loads(line)["text"] for line in path.read_text().splitlines()]
        assert texts == [continuation(p)[:MAX_TOKENS] for p in PROMPTS], name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mp.jsonl", "prompts.txt", "torchrun.jsonl"]
