"""Result lines in the OpenAI batch output format, and the response bodies inside them.

A result is `{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}`; its body a `chat.completion` or `text_completion` object with `choices` and
`usage`, or, for an invalid line (status 400; 404 for a "model" not served), `{"error":
{"message", "type", "param", "code"}}` (the top-level "error" then holds the code and message too). Ids and `created`
come from the job (the input file's digest and modification time), not from a clock or a
random draw, so a resumed run or another layout writes the same bytes.
"""

from __future__ import annotations

from spmd_engine.run.records import json_logprob
from spmd_engine.run_batch.requests import BatchRequest


def error_line(index: int, request: BatchRequest, uid: str, message: str, not_found: bool = False) -> dict:
    """A 400 result, or with `not_found` vLLM's 404 for a "model" it does not serve (OpenAI's
    code for it at the top level)."""
    status, kind, param, code = (404, "NotFoundError", "model", "model_not_found") if not_found else \
        (400, "BadRequestError", None, "invalid_request")
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return {"index": index, "id": f"batch_req_{uid}", "custom_id": request.custom_id,
            "response": {"status_code": status, "request_id": f"req_{uid}", "body": body},
            "error": {"code": code, "message": message}}


def result_line(index: int, request: BatchRequest, uid: str, out, model: str, created: int,
                top_k: int | None) -> dict:
    """A 200 result; `top_k`: how many alternatives each logprobs entry lists (the request's K;
    None: all). Prompt logprobs, when asked for (or by "echo"), go where vLLM puts them: in
    each choice of a completion, beside "usage" in a chat completion."""
    body = {"id": f"{'chatcmpl' if request.is_chat else 'cmpl'}-{uid}",
            "object": "chat.completion" if request.is_chat else "text_completion",
            "created": created, "model": request.body.get("model") or model,
            "choices": [_choice(request, c, top_k, out) for c in out.outputs], "usage": usage(out)}
    if request.is_chat and out.prompt_logprobs is not None:
        body["prompt_logprobs"] = _prompt_logprobs(out.prompt_logprobs)
    return {"index": index, "id": f"batch_req_{uid}", "custom_id": request.custom_id,
            "response": {"status_code": 200, "request_id": f"req_{uid}", "body": body}, "error": None}


def usage(out) -> dict:
    prompt, completion = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _choice(request: BatchRequest, c, k: int | None, out) -> dict:
    if request.is_chat:
        choice = {"index": c.index, "message": {"role": request.role, "content": (request.echo or "") + c.text},
                  "logprobs": _chat_logprobs(c, k) if c.logprobs is not None else None}
        return {**choice, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
    text, token_ids, steps = c.text, list(c.token_ids), c.logprobs
    if request.echo is not None:  # vLLM's: the prompt, its logprobs, then the output's (none for max_tokens 0)
        generated = request.body.get("max_tokens") != 0
        text = request.echo + (text if generated else "")
        token_ids = list(out.prompt_token_ids) + (token_ids if generated else [])
        steps = None if steps is None else list(out.prompt_logprobs) + (list(steps) if generated else [])
    choice = {"index": c.index, "text": text,
              "logprobs": _completion_logprobs(token_ids, steps, k, request.first_token) if steps is not None else None,
              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
    if out.prompt_logprobs is not None:
        choice["prompt_logprobs"] = _prompt_logprobs(out.prompt_logprobs)
    return choice


def _top(step: dict, limit: int | None) -> list:
    """The first `limit` entries of one step's {token id: Logprob} (None: all), in the engine's
    order, as vLLM takes them: the sampled (or prompt) token first, then the top K. So chat's
    K alternatives start with the sampled token, and a completion's K + 1 hold it and the top K."""
    return list(step.values())[:limit]


def _token(lp) -> dict:
    text = lp.decoded_token or ""
    return {"token": text, "logprob": json_logprob(lp.logprob), "bytes": list(text.encode("utf-8"))}


def _chat_logprobs(c, k: int | None) -> dict:
    content = []
    for token_id, step in zip(c.token_ids, c.logprobs):
        content.append({**_token(step[token_id]), "top_logprobs": [_token(lp) for lp in _top(step, k)]})
    return {"content": content}


def _completion_logprobs(token_ids: list[int], steps: list, k: int | None, first_token: str) -> dict:
    """OpenAI's completions logprobs; a step without logprobs (the first prompt token, echoed)
    has its token and nulls, as vLLM writes it."""
    tokens, token_logprobs, top, offsets, offset = [], [], [], [], 0
    limit = None if k is None else k + 1
    for token_id, step in zip(token_ids, steps):
        text = first_token if step is None else step[token_id].decoded_token or ""
        tokens.append(text)
        token_logprobs.append(None if step is None else json_logprob(step[token_id].logprob))
        top.append(None if step is None else {lp.decoded_token or "": json_logprob(lp.logprob) for lp in _top(step, limit)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _prompt_logprobs(steps: list) -> list:
    """vLLM's `prompt_logprobs`: per prompt token {token id: {logprob, rank, decoded_token}}, null
    for the first."""
    return [None if step is None else {str(t): {"logprob": json_logprob(lp.logprob), "rank": lp.rank,
                                                "decoded_token": lp.decoded_token} for t, lp in step.items()}
            for step in steps]
