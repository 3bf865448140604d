"""run_batch's job (see run/records.py for what a job is): one request per batch line.

Every line is checked against the model before any process starts (its prompt
rendered and tokenized, its fields as SamplingParams); a line that fails gets its
error result there and then, and the run goes on with the others. Requests without
a seed are seeded by their line's index, as `run` seeds prompts, so the results do
not depend on the layout.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

from spmd_engine.config import ConfigError
from spmd_engine.run_batch.requests import BadRequest, BatchRequest, completion_prompt, sampling_params
from spmd_engine.run_batch.responses import error_line, result_line

BATCH_OUTPUT_FLAGS = ("model", "seed", "dtype", "max_model_len", "pp_partition", "served_model_name",
                      "logprobs_mode")


class BatchJob:
    output_flags = BATCH_OUTPUT_FLAGS
    drop_index = True  # result lines are OpenAI's objects; the part files' "index" stays there

    def __init__(self, requests: list[BatchRequest], data: bytes, created: int, model_name: str,
                 chat_template: str | None):
        self.requests, self.created, self.model_name, self.chat_template = requests, created, model_name, chat_template
        self.digest = hashlib.sha256(data + repr((chat_template, model_name)).encode()).hexdigest()
        self.prompts: dict[int, object] = {}
        self.params = {}

    def __len__(self) -> int:
        return len(self.requests)

    def key(self) -> str:
        return self.digest

    def check(self, setup) -> None:
        inputs, model_dir = setup.inputs, setup.config.model_config.model_dir
        for index, request in enumerate(self.requests):
            if request.error is not None:
                continue
            try:
                self._prepare(index, request, inputs, model_dir)
            except (ConfigError, BadRequest) as exc:
                request.error = str(exc)

    def _prepare(self, index: int, request: BatchRequest, inputs, model_dir: str) -> None:
        if request.is_chat:
            from spmd_engine.engine.chat_template import chat_prompt, choose_template, normalize_messages
            tools = request.body.get("tools")
            template = choose_template(model_dir, self.chat_template, tools)
            prompt = chat_prompt(inputs.tokenizer, model_dir, normalize_messages(request.body["messages"]),
                                 template, tools=tools)
        else:
            prompt = completion_prompt(request.body)
        text, ids = inputs.encode(prompt, index)
        params = sampling_params(request, len(ids), inputs.max_model_len)
        if params.stop and inputs.tokenizer is None:
            raise BadRequest("stop strings need a tokenizer, and this model has none")
        self.prompts[index] = {"prompt": text, "prompt_token_ids": ids} if text is not None else ids
        self.params[index] = params

    def _uid(self, index: int) -> str:
        return hashlib.sha256(f"{self.digest}:{index}".encode()).hexdigest()[:24]

    def ready_record(self, index: int) -> dict | None:
        request = self.requests[index]
        if request.error is None:
            return None
        return error_line(index, request, self._uid(index), request.error)

    def request(self, index: int, engine_seed: int):
        from spmd_engine.engine.llm import request_seed
        params = self.params[index]
        if params.seed is None:
            params = replace(params, seed=request_seed(engine_seed, index))
        return self.prompts[index], params

    def record(self, index: int, out) -> dict:
        return result_line(index, self.requests[index], self._uid(index), out, self.model_name, self.created,
                           self.params[index].logprobs or 0)
