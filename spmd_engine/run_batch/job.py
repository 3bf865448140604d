"""run_batch's job (see run/records.py for what a job is): one request per batch line.

Every line is checked against the model before any process starts (its prompt
rendered and tokenized, its fields as SamplingParams); a line that fails gets its
error result there and then, and the run goes on with the others. Requests without
a seed are seeded by their line's index, as `run` seeds prompts, so the results do
not depend on the layout. With --lora-modules a body's "model" chooses the adapter, as
in vLLM's server: absent or the served model's name is the base model, an adapter's
name that adapter, any other name vLLM's 404 for that line alone.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

from spmd_engine.config import ConfigError
from spmd_engine.lora_request import LoRARequest
from spmd_engine.run.lora_modules import ServedAdapters
from spmd_engine.run_batch.requests import BadRequest, BatchRequest, completion_prompt, sampling_params
from spmd_engine.run_batch.responses import error_line, result_line

# Arguments the renderer sets itself: the same names in chat_template_kwargs give way to them.
RENDER_ARGS = ("messages", "tools", "add_generation_prompt", "continue_final_message")
BATCH_OUTPUT_FLAGS = ("model", "seed", "dtype", "max_model_len", "pp_partition", "served_model_name",
                      "logprobs_mode", "lora_modules", "lora_dtype")


class BatchJob:
    output_flags = BATCH_OUTPUT_FLAGS
    drop_index = True  # result lines are OpenAI's objects; the part files' "index" stays there

    def __init__(self, requests: list[BatchRequest], data: bytes, created: int, model_name: str,
                 chat_template: str | None, adapters: ServedAdapters | None = None):
        self.requests, self.created, self.model_name, self.chat_template = requests, created, model_name, chat_template
        self.digest = hashlib.sha256(data + repr((chat_template, model_name)).encode()).hexdigest()
        self.prompts: dict[int, object] = {}
        self.params = {}
        self.adapters = adapters or ServedAdapters(model_name)
        self.loras: dict[int, LoRARequest] = {}
        self.not_found: set[int] = set()
        if self.adapters:
            for index, request in enumerate(requests):
                self._choose_adapter(index, request)

    def _choose_adapter(self, index: int, request: BatchRequest) -> None:
        """The adapter the body's "model" names (vLLM's check_model; its 404 otherwise)."""
        if request.error is not None:
            return
        model = request.body.get("model")
        try:
            lora = self.adapters.resolve(model)
        except (KeyError, TypeError):  # a name not served, or not a name at all
            request.error = f"The model `{model}` does not exist. Valid aliases: {self.adapters.base_name}."
            self.not_found.add(index)
            return
        if lora is not None:
            self.loras[index] = lora

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
        body = request.body
        if request.is_chat:
            prompt = self._chat_prompt(request, inputs.tokenizer, model_dir)
        else:
            prompt = completion_prompt(body)
            if isinstance(prompt, str) and body.get("add_special_tokens") is False and inputs.tokenizer is not None:
                prompt = {"prompt": prompt, "prompt_token_ids": inputs.tokenizer.encode(prompt, add_special_tokens=False)}
        text, ids = inputs.encode(prompt, index)
        params = sampling_params(request, len(ids), inputs.max_model_len, inputs.default_sampling_kwargs)
        inputs.check_params(params, index)
        if params.stop and inputs.tokenizer is None:
            raise BadRequest("stop strings need a tokenizer, and this model has none")
        if body.get("echo") and not request.is_chat:  # vLLM decodes a token-id prompt to echo it
            request.echo = text if text is not None else inputs.decode(ids, skip_special_tokens=False)
            request.first_token = inputs.decode(ids[:1], skip_special_tokens=False)
        self.prompts[index] = {"prompt": text, "prompt_token_ids": ids} if text is not None else ids
        self.params[index] = params

    def _chat_prompt(self, request: BatchRequest, tokenizer, model_dir: str) -> dict:
        """The conversation rendered with the body's template arguments, as vLLM's chat: the
        body's own fields win over the same names in chat_template_kwargs."""
        from spmd_engine.engine.chat_template import chat_prompt, choose_template, normalize_messages
        body, tools = request.body, request.body.get("tools")
        messages = normalize_messages(body["messages"])
        generation_prompt = body.get("add_generation_prompt") is not False
        variables = {k: v for k, v in (body.get("chat_template_kwargs") or {}).items() if k not in RENDER_ARGS}
        if body.get("documents") is not None:
            variables["documents"] = body["documents"]
        prompt = chat_prompt(tokenizer, model_dir, messages, choose_template(model_dir, self.chat_template, tools),
                             add_generation_prompt=generation_prompt, tools=tools, variables=variables,
                             continue_final_message=bool(body.get("continue_final_message")))
        request.role = "assistant" if generation_prompt else messages[-1]["role"]
        if body.get("echo"):  # the last message, when the reply continues its role
            last = messages[-1].get("content")
            request.echo = last if messages[-1]["role"] == request.role and isinstance(last, str) else ""
        if body.get("add_special_tokens"):
            prompt["prompt_token_ids"] = tokenizer.encode(prompt["prompt"])
        return prompt

    def _uid(self, index: int) -> str:
        return hashlib.sha256(f"{self.digest}:{index}".encode()).hexdigest()[:24]

    def ready_record(self, index: int) -> dict | None:
        request = self.requests[index]
        if request.error is None:
            return None
        return error_line(index, request, self._uid(index), request.error, not_found=index in self.not_found)

    def request(self, index: int, engine_seed: int):
        from spmd_engine.engine.llm import request_seed
        params = self.params[index]
        if params.seed is None:
            params = replace(params, seed=request_seed(engine_seed, index))
        return self.prompts[index], params

    def lora_request(self, index: int) -> LoRARequest | None:
        return self.loras.get(index)

    def record(self, index: int, out) -> dict:
        k = self.params[index].logprobs
        return result_line(index, self.requests[index], self._uid(index), out, self.model_name, self.created,
                           None if k == -1 else k or 0)
