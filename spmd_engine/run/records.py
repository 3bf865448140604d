"""A run's results: one record per prompt (the output file's JSON object), generated in
input order over the indices a replica owns, streamed to a sink as they finish."""

from __future__ import annotations

from spmd_engine.run.progress import Progress
from spmd_engine.run.prompts import PromptInput
from spmd_engine.sampling_params import SamplingParams


def result_record(index: int, prompt: PromptInput, out) -> dict:
    completion = out.outputs[0]
    record = {
        "index": index,
        "prompt": prompt.text,
        "prompt_token_ids": out.prompt_token_ids,
        "token_ids": completion.token_ids,
        "text": completion.text,
        "finish_reason": completion.finish_reason,
    }
    if completion.logprobs is not None:
        record["logprobs"] = [{str(k): v.logprob for k, v in step.items()} for step in completion.logprobs]
    return record


def generate_records(llm, prompts: list[PromptInput], params: SamplingParams, indices: list[int],
                     progress: Progress | None = None, sink=None) -> list[dict]:
    """Generate for a share of the prompts, seeding each by its global index (a replica's
    share can be empty: fewer prompts than replicas). `sink.append(record)` gets each
    record as soon as its request finishes (the part file)."""
    if not indices:
        if llm.dp_waves:  # no prompts here, but the other replicas' steps need this one's
            llm.generate([], params)
        return []
    from dataclasses import replace

    from spmd_engine.engine.llm import request_seed
    per_prompt = [replace(params, seed=request_seed(llm.seed, i)) for i in indices]
    on_output = None
    if sink is not None:
        def on_output(position, out):
            sink.append(result_record(indices[position], prompts[indices[position]], out))
    outs = llm.generate([prompts[i].as_llm_input() for i in indices], per_prompt,
                        progress=progress.update if progress is not None else None, on_output=on_output)
    return [result_record(i, prompts[i], out) for i, out in zip(indices, outs)]


def print_records(records: list[dict]) -> None:
    """Without --output: every result on stdout, in input order (with --output the part
    files are merged into the file instead; see spmd_engine.run.output_parts)."""
    for r in records:
        header = f"=== prompt {r['index']} ({r['finish_reason']}, {len(r['token_ids'])} tokens)"
        print(header)
        print((r["prompt"] or "") + r["text"], flush=True)
