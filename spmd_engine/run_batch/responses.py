"""Result lines in the OpenAI batch output format, and the response bodies inside them.

A result is `{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}`; its body a `chat.completion` or `text_completion` object with `choices` and
`usage`, or, for an invalid line (status 400), `{"error": {"message", "type", "param",
"code"}}` (the top-level "error" then holds the code and message too). Ids and `created`
come from the job (the input file's digest and modification time), not from a clock or a
random draw, so a resumed run or another layout writes the same bytes.
"""

from __future__ import annotations

from spmd_engine.run.records import json_logprob
from spmd_engine.run_batch.requests import BatchRequest


def error_line(index: int, request: BatchRequest, uid: str, message: str) -> dict:
    body = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}
    return {"index": index, "id": f"batch_req_{uid}", "custom_id": request.custom_id,
            "response": {"status_code": 400, "request_id": f"req_{uid}", "body": body},
            "error": {"code": "invalid_request", "message": message}}


def result_line(index: int, request: BatchRequest, uid: str, out, model: str, created: int, top_k: int) -> dict:
    """A 200 result; `top_k`: how many alternatives each logprobs entry lists (the request's K)."""
    body = {"id": f"{'chatcmpl' if request.is_chat else 'cmpl'}-{uid}",
            "object": "chat.completion" if request.is_chat else "text_completion",
            "created": created, "model": request.body.get("model") or model,
            "choices": [_choice(request, c, top_k) for c in out.outputs], "usage": usage(out)}
    return {"index": index, "id": f"batch_req_{uid}", "custom_id": request.custom_id,
            "response": {"status_code": 200, "request_id": f"req_{uid}", "body": body}, "error": None}


def usage(out) -> dict:
    prompt, completion = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _choice(request: BatchRequest, c, k: int) -> dict:
    if request.is_chat:
        choice = {"index": c.index, "message": {"role": "assistant", "content": c.text},
                  "logprobs": _chat_logprobs(c, k) if c.logprobs is not None else None}
    else:
        choice = {"index": c.index, "text": c.text,
                  "logprobs": _completion_logprobs(c, k) if c.logprobs is not None else None}
    return {**choice, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}


def _top(step: dict, k: int) -> list:
    """The top K of one step's {token id: Logprob}, most likely first (the dict also holds the
    sampled token, ranked where it falls)."""
    return sorted(step.values(), key=lambda lp: lp.rank)[:k]


def _token(lp) -> dict:
    text = lp.decoded_token or ""
    return {"token": text, "logprob": json_logprob(lp.logprob), "bytes": list(text.encode("utf-8"))}


def _chat_logprobs(c, k: int) -> dict:
    content = []
    for token_id, step in zip(c.token_ids, c.logprobs):
        content.append({**_token(step[token_id]), "top_logprobs": [_token(lp) for lp in _top(step, k)]})
    return {"content": content}


def _completion_logprobs(c, k: int) -> dict:
    tokens, token_logprobs, top, offsets, offset = [], [], [], [], 0
    for token_id, step in zip(c.token_ids, c.logprobs):
        text = step[token_id].decoded_token or ""
        tokens.append(text)
        token_logprobs.append(json_logprob(step[token_id].logprob))
        top.append({lp.decoded_token or "": json_logprob(lp.logprob) for lp in _top(step, k)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
