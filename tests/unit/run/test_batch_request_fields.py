"""run_batch's request bodies: every sampling field of vLLM's request models reaches
SamplingParams with vLLM's defaults, a field that would change the result and is not
implemented is a 400 naming it (its default value is not), fields vLLM has no model for
get one warning, and echo / the chat reply's role / template arguments come out as vLLM's."""

import json
import logging
from types import SimpleNamespace

import pytest

from spmd_engine.engine.input_processor import InputProcessor
from spmd_engine.engine.outputs import CompletionOutput, Logprob, RequestOutput
from spmd_engine.model.loader import BUNDLED_MODEL_DIR
from spmd_engine.run_batch.job import BatchJob
from spmd_engine.run_batch.requests import BadRequest, parse_line, read_requests, sampling_params
from spmd_engine.run_batch.responses import result_line

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "Flat is"}]


def line(url=COMPLETIONS, **body):
    if url == COMPLETIONS:
        body.setdefault("prompt", "Simple is")
    else:
        body.setdefault("messages", MESSAGES)
    return json.dumps({"custom_id": "c", "method": "POST", "url": url, "body": body})


def params(url=COMPLETIONS, prompt_len=4, max_model_len=100, defaults=None, **body):
    request = parse_line(line(url, **body), 1)
    assert request.error is None, request.error
    return sampling_params(request, prompt_len, max_model_len, defaults)


def error(url=COMPLETIONS, **body):
    return parse_line(line(url, **body), 1).error


@pytest.mark.parametrize("url", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("field, value, attr, expected", [
    ("top_k", 1, "top_k", 1), ("min_p", 0.2, "min_p", 0.2), ("repetition_penalty", 1.3, "repetition_penalty", 1.3),
    ("presence_penalty", 0.5, "presence_penalty", 0.5), ("frequency_penalty", -0.5, "frequency_penalty", -0.5),
    ("stop", "x", "stop", ["x"]), ("stop_token_ids", [7, 9], "stop_token_ids", [7, 9]),
    ("ignore_eos", True, "ignore_eos", True), ("min_tokens", 3, "min_tokens", 3),
    ("logit_bias", {"65": 5}, "logit_bias", {65: 5.0}), ("seed", 11, "seed", 11), ("n", 3, "n", 3),
    ("include_stop_str_in_output", True, "include_stop_str_in_output", True),
    ("skip_special_tokens", False, "skip_special_tokens", False), ("allowed_token_ids", [65, 66], "allowed_token_ids", [65, 66]),
    ("bad_words", ["ugly"], "bad_words", ["ugly"]), ("prompt_logprobs", 2, "prompt_logprobs", 2),
    ("temperature", 0.5, "temperature", 0.5), ("top_p", 0.9, "top_p", 0.9), ("max_tokens", 7, "max_tokens", 7),
])
def test_each_sampling_field_reaches_sampling_params(url, field, value, attr, expected):
    body = {"temperature": 0.7, field: value}  # not greedy: greedy drops top_k, top_p and min_p
    assert getattr(params(url, **body), attr) == expected


def test_logprobs_and_chat_only_fields():
    assert params(logprobs=3).logprobs == 3
    assert params(CHAT, logprobs=True, top_logprobs=4).logprobs == 4
    assert params(CHAT, logprobs=True).logprobs == 0
    assert params(CHAT, max_completion_tokens=5, max_tokens=9).max_tokens == 5
    assert "needs \"logprobs\": true" in error(CHAT, top_logprobs=2)


def test_defaults_are_vllms_and_the_models():
    p = params()
    assert (p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.max_tokens) == (1.0, 1.0, 0.0, 1.0, 16)
    assert params(CHAT, prompt_len=30).max_tokens == 70  # chat: the rest of the context
    model = {"temperature": 0.6, "top_k": 20, "max_tokens": 9}
    p = params(CHAT, defaults=model)
    assert (p.temperature, p.top_k, p.max_tokens) == (0.6, 20, 9)
    assert params(CHAT, defaults=model, temperature=0.3, max_tokens=4).temperature == 0.3
    assert params(max_tokens=95, prompt_len=90, max_model_len=100).max_tokens == 10  # cut to the context
    with pytest.raises(BadRequest, match='"max_tokens" = 101 cannot be greater than max_model_len = 100'):
        params(max_tokens=101)


@pytest.mark.parametrize("url, field, value", [
    (COMPLETIONS, "suffix", "end"), (COMPLETIONS, "tools", [{"type": "function"}]), (COMPLETIONS, "best_of", 3),
    (CHAT, "guided_json", {"type": "object"}), (COMPLETIONS, "guided_choice", ["a"]),
    (CHAT, "use_beam_search", True),
    (COMPLETIONS, "logprob_token_ids", [1]), (COMPLETIONS, "prompt_embeds", "AAAA"),
    (CHAT, "truncate_prompt_tokens", 5), (CHAT, "reasoning_effort", "low"), (CHAT, "chat_template", "{{ x }}"),
    (COMPLETIONS, "priority", 1),
    (CHAT, "return_token_ids", True), (COMPLETIONS, "vllm_xargs", {"a": 1}),
    (CHAT, "stream_options", {"include_usage": True}), (CHAT, "repetition_detection", {"max_pattern_size": 2}),
    (CHAT, "thinking_token_budget", 8), (COMPLETIONS, "kv_transfer_params", {"a": 1}),
])
def test_unsupported_fields_are_400_naming_them(url, field, value):
    assert f'"{field}" is not supported by spmd_engine' in error(url, **{field: value})


def test_unsupported_fields_at_their_default_and_harmless_fields_are_accepted():
    defaults = dict(response_format={"type": "text"}, suffix=None, best_of=2, n=2, use_beam_search=False,
                    priority=0, spaces_between_special_tokens=False, stream=False, user="u", model="m",
                    request_id="r", length_penalty=1.0, thinking_token_budget=-1, logprob_token_ids=None)
    assert error(**defaults) is None and error(CHAT, **defaults, parallel_tool_calls=True) is None
    assert '"tool_choice"' in error(CHAT, tools=[{"type": "function"}], tool_choice="required")
    assert error(CHAT, tools=[{"type": "function"}], tool_choice="auto") is None


def test_fields_outside_vllms_models_warn_once(tmp_path, caplog):
    path = tmp_path / "in.jsonl"
    path.write_text(line(foo=1, bar=2) + "\n" + line(CHAT, foo=3, max_completion_tokens=4) + "\n")
    with caplog.at_level(logging.WARNING, logger="spmd_engine"):
        requests, _ = read_requests(str(path))
    assert [r.error for r in requests] == [None, None]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].endswith(": bar, foo"), warnings  # chat's max_completion_tokens is vLLM's


def checked(*lines, template="{% for m in messages %}{{ m['content'] }}|{{ x }}|{{ documents }}{% endfor %}"):
    """A job over these lines, checked against the bundled model (tokenizer and config only)."""
    requests = [parse_line(text, n) for n, text in enumerate(lines, 1)]
    job = BatchJob(requests, b"", 0, "bundled", template)
    inputs = InputProcessor(str(BUNDLED_MODEL_DIR))
    job.check(SimpleNamespace(inputs=inputs, config=SimpleNamespace(model_config=SimpleNamespace(
        model_dir=str(BUNDLED_MODEL_DIR)))))
    return job


def test_chat_template_arguments_role_and_echo():
    conversation = [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}]
    job = checked(line(CHAT, messages=conversation, chat_template_kwargs={"x": "kw", "add_generation_prompt": 1},
                       documents=[{"text": "d"}]),
                  line(CHAT, messages=conversation, add_generation_prompt=False, echo=True, add_special_tokens=True),
                  line(CHAT, messages=conversation, echo=True),
                  line(CHAT, messages=conversation, chat_template_kwargs={"tokenize": True}))
    assert job.prompts[0]["prompt"] == "A|kw|[{'text': 'd'}]B|kw|[{'text': 'd'}]"
    assert job.prompts[1]["prompt_token_ids"][0] == 256  # add_special_tokens: BOS before the template's text
    assert (job.requests[1].role, job.requests[1].echo) == ("assistant", "B")
    assert (job.requests[2].role, job.requests[2].echo) == ("assistant", "B")
    conversation[-1]["role"] = "user"
    job = checked(line(CHAT, messages=conversation, add_generation_prompt=False, echo=True),
                  line(CHAT, messages=conversation, echo=True))
    assert (job.requests[0].role, job.requests[0].echo) == ("user", "B")  # the reply continues the last message
    assert (job.requests[1].role, job.requests[1].echo) == ("assistant", "")


def test_completion_prompt_special_tokens_and_bad_ids_are_400():
    job = checked(line(prompt="ab", add_special_tokens=False), line(prompt="ab"), line(logit_bias={"999": 1}))
    assert job.prompts[0]["prompt_token_ids"] == [97, 98] and job.prompts[1]["prompt_token_ids"] == [256, 97, 98]
    assert "logit_bias has token id 999" in job.requests[2].error


def lp(token, logprob, rank):
    return {token: Logprob(logprob, rank, chr(token))}


def output(prompt, prompt_ids, logprobs, prompt_logprobs):
    """One sample "c" (token 99) after the prompt."""
    sample = CompletionOutput(0, "c", [99], 0.0, logprobs, finish_reason="length")
    return RequestOutput(request_id="r", prompt=prompt, prompt_token_ids=prompt_ids, prompt_logprobs=prompt_logprobs,
                         outputs=[sample], finished=True)


def test_echo_prepends_the_prompt_and_its_logprobs():
    job = checked(line(prompt="ab", echo=True, logprobs=0, max_tokens=1), line(prompt="ab", echo=True, max_tokens=0))
    out = output("ab", [256, 97, 98], [lp(99, -0.5, 1)], [None, lp(97, -1.0, 2), lp(98, -2.0, 1)])
    body = job.record(0, out)["response"]["body"]
    choice = body["choices"][0]
    assert choice["text"] == "abc"
    assert choice["logprobs"]["tokens"] == ["", "a", "b", "c"]
    assert choice["logprobs"]["token_logprobs"] == [None, -1.0, -2.0, -0.5]
    assert choice["logprobs"]["top_logprobs"][0] is None
    assert choice["prompt_logprobs"][1] == {"97": {"logprob": -1.0, "rank": 2, "decoded_token": "a"}}
    assert body["usage"]["completion_tokens"] == 1
    assert job.params[0].prompt_logprobs == 0 and job.params[1].max_tokens == 1
    assert choice["logprobs"]["top_logprobs"][1] == {"a": -1.0}  # logprobs=0: the token itself (vLLM's K + 1)
    out.outputs[0].logprobs = None
    only_prompt = job.record(1, out)["response"]["body"]["choices"][0]
    assert only_prompt["text"] == "ab" and only_prompt["logprobs"] is None
    assert "max_tokens" in error(max_tokens=0)  # without echo, vLLM refuses it too


def test_chat_echo_in_the_reply():
    job = checked(line(CHAT, messages=[{"role": "assistant", "content": "B"}], add_generation_prompt=False,
                       echo=True))
    out = output("B", [66], None, [None])
    body = result_line(0, job.requests[0], "u", out, "m", 0, 0)["response"]["body"]
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Bc"}
    assert body["prompt_logprobs"] == [None]


def test_top_logprobs_in_vllms_order():
    """The engine's order (sampled token first), as vLLM takes it: chat's first K, a completion's K + 1."""
    step = {99: Logprob(-2.0, 3, "c"), 97: Logprob(-0.1, 1, "a"), 98: Logprob(-1.0, 2, "b")}
    job = checked(line(CHAT, logprobs=True, top_logprobs=2), line(logprobs=1))
    out = output("x", [120], [step], None)
    chat = job.record(0, out)["response"]["body"]["choices"][0]["logprobs"]["content"][0]
    assert [t["token"] for t in chat["top_logprobs"]] == ["c", "a"]
    completion = job.record(1, out)["response"]["body"]["choices"][0]["logprobs"]
    assert list(completion["top_logprobs"][0]) == ["c", "a"]


def test_response_format_and_structured_outputs_become_the_constraint():
    """OpenAI's response_format and vLLM's structured_outputs body field (docs/structured-outputs.md);
    a bad one is a 400 naming what is wrong (control: the mapping dropped, each assert fails)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    so = params(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}).structured_outputs
    assert (so.kind, so.json) == ("json", schema)
    assert params(CHAT, response_format={"type": "json_object"}).structured_outputs.json_object is True
    assert params(response_format={"type": "text"}).structured_outputs is None
    assert params(structured_outputs={"regex": "a+"}).structured_outputs.regex == "a+"
    for body, message in ((dict(response_format={"type": "json_schema"}), "needs"),
                          (dict(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
                           "cannot both be set"),
                          (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "only one constraint"),
                          (dict(response_format={"type": "yaml"}), '"response_format" type must be')):
        with pytest.raises(BadRequest, match=message):
            params(CHAT, **body)
