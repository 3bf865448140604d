"""The fields of a request body: read, accepted, refused, or ignored with a warning.

vLLM parses a body into its CompletionRequest or ChatCompletionRequest. Here a field this
engine implements is read (requests.py); one that cannot change a result here is accepted;
one that would change it and that the engine does not implement is refused (a 400 naming
it) unless it holds its default, so a client that spells every field out still runs. A
field outside vLLM's models is ignored, as vLLM ignores it, but with a warning rather than
vLLM's debug line; except those a client sends meaning a change that would silently not
happen: `best_of` other than n, vLLM's removed guided_* fields, completions' `tools`.
"""

from __future__ import annotations


class BadRequest(ValueError):
    """What is wrong with one line: its error result's message."""


def _unset(value) -> bool:
    return value is None or value is False or (isinstance(value, (list, dict, str)) and not value)


_COMMON_READ = {
    "model", "stream", "n", "max_tokens", "seed", "stop", "stop_token_ids", "temperature", "top_p", "top_k",
    "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
    "prompt_logprobs", "ignore_eos", "min_tokens", "include_stop_str_in_output", "skip_special_tokens",
    "allowed_token_ids", "bad_words", "echo", "add_special_tokens", "response_format", "structured_outputs"}
READ = {
    False: _COMMON_READ | {"prompt"},
    True: _COMMON_READ | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                          "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "documents"}}

# Scheduling, tracing, render-only and streaming-only fields, length_penalty (beam search only) and
# spaces_between_special_tokens (vLLM reads it for slow tokenizers only; every one here is fast).
_COMMON_ACCEPTED = {"user", "request_id", "session_id", "cache_salt", "stream_interval", "length_penalty",
                    "spaces_between_special_tokens",
                    "truncation_side", "routed_experts_prompt_start", "return_token_offsets", "mm_payload",
                    "return_mm_kwargs"}
ACCEPTED = {False: _COMMON_ACCEPTED,
            True: _COMMON_ACCEPTED | {"parallel_tool_calls", "include_reasoning", "media_io_kwargs",
                                      "mm_processor_kwargs"}}

# name: whether a value leaves the result as this engine makes it.
_COMMON_REFUSED = {
    "stream_options": _unset,  # vLLM refuses it too without "stream": true
    "use_beam_search": _unset, "watermarking": _unset, "truncate_prompt_tokens": lambda v: v is None,
    "logprob_token_ids": _unset,
    "priority": lambda v: v is None or v == 0, "thinking_token_budget": lambda v: v is None or v == -1,
    "return_tokens_as_token_ids": _unset, "return_token_ids": _unset, "return_weight_versions": _unset,
    "kv_transfer_params": _unset, "ec_transfer_params": _unset, "vllm_xargs": _unset,
    "repetition_detection": _unset,
    **{f"guided_{kind}": _unset for kind in ("json", "regex", "choice", "grammar", "decoding_backend",
                                             "whitespace_pattern")}}
REFUSED = {False: {**_COMMON_REFUSED, "suffix": _unset, "prompt_embeds": _unset, "tools": _unset},
           True: {**_COMMON_REFUSED, "reasoning_effort": lambda v: v is None, "chat_template": lambda v: v is None,
                  "return_prompt_text": _unset}}


def check_fields(body: dict, is_chat: bool) -> list[str]:
    """The names outside vLLM's models (to warn about); raises BadRequest for a refused one."""
    refused = REFUSED[is_chat]
    for name, value in body.items():
        if name in refused and not refused[name](value):
            raise BadRequest(f'"{name}" is not supported by spmd_engine')
    best_of = body.get("best_of")
    if best_of is not None and best_of != (body.get("n") or 1):
        raise BadRequest(f'"best_of" is not supported by spmd_engine (got {best_of!r}; only best_of = n)')
    known = READ[is_chat] | ACCEPTED[is_chat] | set(refused) | {"best_of"}
    return [name for name in body if name not in known]
