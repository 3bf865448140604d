"""One workload through several engine layouts in turn, in one launch (batch_invariant tests).

    torchrun --nproc-per-node 8 batch_invariant_layouts.py PLAN_JSON OUT_JSON

PLAN_JSON: [{"model": dir, "layout": {LLM kwargs}}, ...]; each entry builds an engine
(external_launcher), runs `workload` and shuts it down; global rank 0 writes the list of
results. `workload` is also what the tests run in-process (uni, mp) for the reference.
"""

from __future__ import annotations

import json
import os
import random
import sys

from spmd_engine import LLM, SamplingParams

MAX_TOKENS = 6


def prompts(vocab: int, seed: int = 0, count: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(2, 70))] for _ in range(count)]


def record(out) -> dict:
    """Tokens, logprobs (id -> [logprob, rank]) and prompt logprobs of one output, as JSON."""
    c = out.outputs[0]
    entries = lambda d: None if d is None else {str(k): [v.logprob, v.rank] for k, v in d.items()}  # noqa: E731
    return {"tokens": list(c.token_ids), "logprobs": [entries(d) for d in c.logprobs],
            "prompt_logprobs": out.prompt_logprobs and [entries(d) for d in out.prompt_logprobs]}


def workload(llm: LLM, vocab: int) -> list[dict]:
    """A batch of prompts, greedy and seeded-sampled, with logprobs=5 and prompt_logprobs=5."""
    ps = prompts(vocab)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5, prompt_logprobs=5, ignore_eos=True)
    sampled = SamplingParams(max_tokens=MAX_TOKENS, logprobs=5, temperature=1.0, top_p=0.9, seed=7,
                             ignore_eos=True)
    outs = llm.generate(ps + ps, [greedy] * len(ps) + [sampled] * len(ps), use_tqdm=False)
    return [record(o) for o in outs]


if __name__ == "__main__":
    plan, out_file = json.load(open(sys.argv[1])), sys.argv[2]
    results = []
    for entry in plan:
        vocab = json.load(open(os.path.join(entry["model"], "config.json")))["vocab_size"]
        llm = LLM(model=entry["model"], distributed_executor_backend="external_launcher", seed=0,
                  **entry["layout"])
        results.append(workload(llm, vocab))
        llm.shutdown()
    if os.environ.get("RANK", "0") == "0":
        json.dump(results, open(out_file, "w"))
