"""The bundled model recites its training text at every layout (mp executor).

Each of the Zen's 19 lines is a prompt; together the continuations cover the
whole text, so a wrong shard, stage or KV-head replica shows up as wrong text.
"""

from __future__ import annotations

import pytest
from zen import zen

from spmd_engine import LLM, SamplingParams

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


def recitation_problems(cases, outs) -> list[str]:
    """Every prompt's output, exactly its NEW_TOKENS expected bytes, cut by length (not stopped early)."""
    problems = [] if len(outs) == len(cases) else [f"{len(outs)} outputs for {len(cases)} prompts"]
    for (prompt, expected), out in zip(cases, outs):
        completion = out.outputs[0]
        if completion.token_ids != list(expected) or completion.finish_reason != "length":
            problems.append(f"{prompt!r}: {completion.finish_reason} after {bytes(t for t in completion.token_ids if t < 256)!r}, "
                            f"expected {expected!r}")
    return problems


WORLD8 = pytest.mark.xdist_group("world8")  # 8 workers: never two such tests at once


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [
    dict(tensor_parallel_size=2),
    dict(tensor_parallel_size=4),   # 2 KV heads: each replicated on 2 ranks
    pytest.param(dict(tensor_parallel_size=8), marks=WORLD8),   # each KV head on 4 ranks, 1 query head per rank
    pytest.param(dict(pipeline_parallel_size=8), marks=WORLD8),  # one layer per stage
    dict(pipeline_parallel_size=3, pp_partition="2,5,1"),
    pytest.param(dict(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2), marks=WORLD8),
], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_bundled_model_recites_at_layout(layout):
    cases = line_prompts()
    assert len(cases) == 19 and all(len(expected) == NEW_TOKENS for _, expected in cases)
    with LLM(max_num_seqs=len(cases), **layout) as llm:
        outs = llm.generate([p for p, _ in cases], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    assert not recitation_problems(cases, outs)


def test_recitation_check_catches_early_stop_and_missing_output():
    """Negative control: the check above fails on an output that stops early or is missing."""
    from spmd_engine.engine.outputs import CompletionOutput, RequestOutput

    cases = line_prompts()[:3]

    def out(tokens, reason):
        return RequestOutput("0", "", [], None, [CompletionOutput(0, "", list(tokens), None, None,
                                                                  finish_reason=reason)], True)
    good = [out(expected, "length") for _, expected in cases]
    assert not recitation_problems(cases, good)
    stopped = [*good[:2], out([*cases[2][1][:10], 257], "stop")]
    assert recitation_problems(cases, stopped)
    assert recitation_problems(cases, good[:2])  # zip alone would have hidden the missing one
    assert recitation_problems(cases, [*good[:2], out(cases[2][1][:-1] + b"!", "length")])
