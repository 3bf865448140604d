"""Outputs as code written for vLLM reads them, on the bundled model.

Logprobs: logprobs=-1 and prompt_logprobs=-1 are the whole vocabulary, each position's dict
holds the sampled (or prompt) token first, then every other id from most to least likely,
with vLLM's ranks; the reference is transformers' logits of the same checkpoint (teacher
forced), so two float computations may differ by ~1e-6: a rank is checked exactly unless a
neighbour lies within EPS. Streams: DELTA outputs through llm_engine.add_request / step
join into the final text however the stop string falls across tokens, and no CUMULATIVE
text shows what the final one drops; the reference is `generate` (and the Zen of Python,
which the bundled model recites).
"""

from __future__ import annotations

import pytest
import torch
from zen import continuation

from spmd_engine import LLM, RequestOutputKind, SamplingParams

EPS, TOL = 1e-4, 2e-4
PROMPT = "Beautiful is"


@pytest.fixture(scope="module")
def llm():
    with LLM(max_model_len=256, max_logprobs=-1) as llm:
        yield llm


@pytest.fixture(scope="module")
def hf(llm):
    from conftest import require_reference
    transformers = require_reference("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(llm.config.model_config.model_dir,
                                                             dtype=torch.float32).eval()


@torch.inference_mode()
def reference_logp(hf, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits: row j rates token j + 1."""
    return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def rank_window(row: torch.Tensor, value: float) -> tuple[int, int]:
    """vLLM's rank of a token whose value is `value` (entries >= it), as a range that allows
    for entries within EPS of it, either side."""
    return int((row > value + EPS).sum()) + 1, int((row >= value - EPS).sum())


def check_position(step: dict, row: torch.Tensor, token: int, k: int, problems: list, where: str) -> None:
    ids = list(step)
    if ids[0] != token:
        problems.append(f"{where}: first id {ids[0]}, not the token {token}")
    k = row.numel() if k == -1 else k
    if len(ids) != k + (step[token].rank > k):  # the token is among the top K unless ranked below
        problems.append(f"{where}: {len(ids)} entries")
    for tid, lp in step.items():
        if abs(lp.logprob - float(row[tid])) > TOL:
            problems.append(f"{where} id {tid}: {lp.logprob} vs {float(row[tid])}")
        low, high = rank_window(row, float(row[tid]))
        if not low <= lp.rank <= high:
            problems.append(f"{where} id {tid}: rank {lp.rank} vs {low}..{high}")
    # Then the top K by place, but the token's own (its entry stays first, with that rank).
    ranks = [step[t].rank for t in ids[1:]]
    if ranks != [r for r in range(1, k + 1) if r != step[token].rank]:
        problems.append(f"{where}: the top entries are not in rank order: {ranks[:8]}...")


@pytest.mark.timeout(180)
def test_minus_one_is_the_whole_vocabulary_in_vllms_order_and_ranks(llm, hf):
    vocab = llm.inputs.vocab_size
    greedy = SamplingParams(temperature=0.0, max_tokens=6, logprobs=-1, prompt_logprobs=-1)
    sampled = SamplingParams(temperature=2.0, seed=3, max_tokens=12, logprobs=2, prompt_logprobs=1)
    problems = []
    for params, prompt_text in ((greedy, PROMPT), (sampled, "qzx")):  # "qzx": not in the Zen, so a wide draw
        (out,) = llm.generate([prompt_text], params)
        c, prompt = out.outputs[0], out.prompt_token_ids
        logp = reference_logp(hf, prompt + c.token_ids)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for j in range(1, len(prompt)):
            check_position(out.prompt_logprobs[j], logp[j - 1], prompt[j], params.prompt_logprobs, problems,
                           f"T={params.temperature} prompt {j}")
        for j, (token, step) in enumerate(zip(c.token_ids, c.logprobs)):
            check_position(step, logp[len(prompt) + j - 1], token, params.logprobs, problems,
                           f"T={params.temperature} output {j}")
        if params is greedy:
            assert all(len(step) == vocab for step in c.logprobs)
            assert all(len(step) == vocab for step in out.prompt_logprobs[1:])
            assert c.text == continuation(PROMPT)[:6]
        else:  # some draws fall below the top 2: there the sampled token's rank is vLLM's count
            below_top = [step[t].rank for t, step in zip(c.token_ids, c.logprobs) if step[t].rank > 2]
            assert below_top and all(len(step) == 3 for t, step in zip(c.token_ids, c.logprobs)
                                     if step[t].rank > 2)
    assert not problems, problems[:10]


def stream(llm, kind: RequestOutputKind, prompts: list[str], **params) -> dict[str, list]:
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, SamplingParams(temperature=0.0, max_tokens=40, output_kind=kind, **params))
    outs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stop", [["than"], ["than", "ugly.\nEx", "silently"], [" b", "Z"], ["n"]],
                         ids=["one", "several", "at-once", "one-char"])
def test_deltas_join_into_the_final_text_and_cumulative_texts_only_grow(llm, stop):
    prompts = [PROMPT, "Errors should", "Simple is"]
    final = [o.outputs[0] for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, stop=stop))]
    deltas = stream(llm, RequestOutputKind.DELTA, prompts, stop=stop)
    cumulative = stream(llm, RequestOutputKind.CUMULATIVE, prompts, stop=stop)
    for i, want in enumerate(final):
        got = deltas[f"s{i}"]
        assert "".join(o.outputs[0].text for o in got) == want.text, [o.outputs[0].text for o in got]
        assert sum((o.outputs[0].token_ids for o in got), []) == want.token_ids
        assert (got[-1].outputs[0].finish_reason, got[-1].outputs[0].stop_reason) == (
            want.finish_reason, want.stop_reason)
        texts = [o.outputs[0].text for o in cumulative[f"s{i}"]]
        assert texts[-1] == want.text and all(want.text.startswith(t) for t in texts), texts
    assert any(f.stop_reason is not None for f in final)
