"""A job's results: one record per input (the output file's JSON object), generated in
input order over the indices a replica owns, streamed to a sink as they finish.

A job is what `run` and `run_batch` differ in; everything else (launch, split over
replicas, part files, resume, merge) is theirs in common (jobs.py, output_parts.py).
It has: `len(job)`; `key()`, a string that names its inputs (resume and the
same-invocation check compare its digest); `output_flags`, the flags that shape a
record; `check(setup)`, every input checked (and rendered) against the model before
any process starts; `ready_record(i)`, a record that needs no generation (an invalid
batch line) or None; `request(i, engine_seed)`, the (prompt, SamplingParams) to
generate; `lora_request(i)`, the LoRA adapter it runs with (None: the base model);
`record(i, out)`, the record of a RequestOutput; and `drop_index`, whether the merged
file leaves out the "index" every part-file line carries.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from spmd_engine.config import ConfigError
from spmd_engine.run.lora_modules import ServedAdapters
from spmd_engine.run.progress import Progress
from spmd_engine.run.prompts import PromptInput, render_conversations
from spmd_engine.sampling_params import SamplingParams

# Flags that change what a `run` record holds; layout and timing flags do not.
RUN_OUTPUT_FLAGS = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "dtype",
                    "max_model_len", "pp_partition", "logprobs_mode", "lora_modules", "lora_dtype")


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
        record["logprobs"] = [{str(k): json_logprob(v.logprob) for k, v in step.items()}
                              for step in completion.logprobs]
    if out.lora_request is not None:  # only lines run with an adapter carry its name
        record["lora"] = out.lora_request.lora_name
    return record


JSON_NEG_INF = -9999.0  # vLLM's OpenAI server's stand-in: JSON has no -Infinity


def json_logprob(value: float) -> float:
    """A logprob fit for strict JSON: a token the processed modes drop (-inf) as vLLM writes it."""
    return JSON_NEG_INF if value == float("-inf") else value


@dataclass
class PromptJob:
    """`run`'s job: prompts (text, ids, conversations) with one SamplingParams, each seeded by
    its index in the whole input."""
    prompts: list[PromptInput]
    params: SamplingParams
    chat_template: str | None = None
    adapters: ServedAdapters | None = None  # --lora-modules, which lines choose from by name
    output_flags = RUN_OUTPUT_FLAGS
    drop_index = False

    def __len__(self) -> int:
        return len(self.prompts)

    def key(self) -> str:
        return repr([(p.text, p.token_ids) + ((p.adapter,) if p.adapter else ()) for p in self.prompts])

    def check(self, setup) -> None:
        inputs = setup.inputs
        if self.params.logprobs is not None and self.params.logprobs > inputs.vocab_size:
            raise ConfigError(f"--logprobs: {self.params.logprobs} is more than the vocabulary "
                              f"({inputs.vocab_size} tokens)")
        self.prompts = render_conversations(self.prompts, setup.config.model_config.model_dir,
                                            inputs.tokenizer, self.chat_template)
        for index, prompt in enumerate(self.prompts):
            try:
                inputs.encode(prompt.as_llm_input(), index)
                if prompt.structured_outputs is not None:
                    inputs.check_params(self.request(index, 0)[1], index)
            except ConfigError as exc:  # name the file and line, not only the index
                raise ConfigError(f"{prompt.where}: {exc}" if prompt.where else str(exc)) from None

    def ready_record(self, index: int) -> None:
        return None

    def request(self, index: int, engine_seed: int):
        from spmd_engine.engine.llm import request_seed
        prompt = self.prompts[index]
        params = replace(self.params, seed=request_seed(engine_seed, index))
        if prompt.structured_outputs is not None:  # the line's own constraint
            params = replace(params, structured_outputs=dict(prompt.structured_outputs))
        return prompt.as_llm_input(), params

    def lora_request(self, index: int):
        return self.adapters.for_line(self.prompts[index].adapter) if self.adapters is not None else None

    def record(self, index: int, out) -> dict:
        return result_record(index, self.prompts[index], out)


def generate_records(llm, job, indices: list[int], progress: Progress | None = None, sink=None) -> list[dict]:
    """Generate for a share of the job (a replica's share can be empty: fewer inputs than
    replicas). `sink.append(record)` gets each record as soon as it is known (the part file):
    ready ones at once, the others as their requests finish. Returns them in index order."""
    ready = {i: r for i in indices if (r := job.ready_record(i)) is not None}
    if sink is not None:
        for record in ready.values():
            sink.append(record)
    todo = [i for i in indices if i not in ready]
    if not todo:
        if llm.dp_waves:  # nothing to generate here, but the other replicas' steps need this one's
            llm.generate([], SamplingParams())
        return list(ready.values())
    requests = [job.request(i, llm.seed) for i in todo]
    loras = [job.lora_request(i) for i in todo]
    on_output = None
    if sink is not None:
        def on_output(position, out):
            sink.append(job.record(todo[position], out))
    outs = llm.generate([prompt for prompt, _ in requests], [params for _, params in requests],
                        progress=progress.update if progress is not None else None, on_output=on_output,
                        lora_request=loras if any(loras) else None)
    records = {**ready, **{i: job.record(i, out) for i, out in zip(todo, outs)}}
    return [records[i] for i in sorted(records)]


def print_records(records: list[dict]) -> None:
    """Without --output: every result on stdout, in input order (with --output the part
    files are merged into the file instead; see spmd_engine.run.output_parts)."""
    for r in records:
        header = f"=== prompt {r['index']} ({r['finish_reason']}, {len(r['token_ids'])} tokens)"
        print(header)
        print((r["prompt"] or "") + r["text"], flush=True)
