"""The bundled model recites its training text at every layout (mp executor).

Each of the Zen's 19 lines is a prompt; together the continuations cover the
whole text, so a wrong shard, stage or KV-head replica shows up as wrong text.
"""

from __future__ import annotations

import pytest

from spmd_engine import LLM, SamplingParams
from zen import zen

NEW_TOKENS = 40


def line_prompts() -> list[tuple[str, bytes]]:
    """(the shortest run of 2+ words that starts a line and occurs once in the text,
    the NEW_TOKENS bytes that follow it)."""
    text = zen()
    out, at = [], text.index("Beautiful")
    for line in text[at:].splitlines(keepends=True):
        words = line.split(" ")
        n = 2
        while text.count(" ".join(words[:n])) > 1:
            n += 1
        prompt = " ".join(words[:n])
        out.append((prompt, text[at + len(prompt):].encode()[:NEW_TOKENS]))
        at += len(line)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [
    dict(tensor_parallel_size=2),
    dict(tensor_parallel_size=4),   # 2 KV heads: each replicated on 2 ranks
    dict(tensor_parallel_size=8),   # each KV head on 4 ranks, 1 query head per rank
    dict(pipeline_parallel_size=8),  # one layer per stage
    dict(pipeline_parallel_size=3, pp_partition="2,5,1"),
    dict(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2),
], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_bundled_model_recites_at_layout(layout):
    cases = line_prompts()
    with LLM(max_num_seqs=len(cases), **layout) as llm:
        outs = llm.generate([p for p, _ in cases], SamplingParams(max_tokens=NEW_TOKENS))
    for (prompt, expected), out in zip(cases, outs):
        got = bytes(t for t in out.outputs[0].token_ids if t < 256)
        assert expected.startswith(got) and (len(got) == len(expected) or out.outputs[0].finish_reason == "stop"), \
            (prompt, got, expected)
