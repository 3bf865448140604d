"""The output processor as vLLM's: streamed text never shows what the final text drops (the
start of a stop string, the first bytes of a character), DELTA outputs joined with vLLM's
RequestOutput.add equal the final output, and the output classes' fields and metrics carry
vLLM 0.34's names and order.

The engine core is played by hand here: tokens of the bundled byte tokenizer (id = byte)
arrive one per step, the real StopStringWatcher finds stop strings as the core does, and
the reference for the final text is a FINAL_ONLY processor fed the same steps.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import random
import time

import pytest

from spmd_engine.config import __file__ as config_file
from spmd_engine.engine.input_processor import InputProcessor
from spmd_engine.engine.output_processor import NewRequest, OutputProcessor
from spmd_engine.engine.outputs import CompletionOutput, RequestOutput, RequestStateStats
from spmd_engine.engine.stop_strings import StopStringWatcher, held_back
from spmd_engine.sampling_params import RequestOutputKind, SamplingParams

BUNDLED = os.path.join(os.path.dirname(config_file), "bundled")
KINDS = (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY)


@pytest.fixture(scope="module")
def inputs():
    return InputProcessor(BUNDLED)


def stream(inputs, tokens: bytes, **params) -> dict:
    """Every output of each kind for one request whose sampler writes `tokens`, one a step."""
    params = dict(max_tokens=len(tokens), temperature=0.0, **params)
    watcher, runs = StopStringWatcher(BUNDLED), {}
    for kind in KINDS:
        op = OutputProcessor(inputs, lambda: None)
        (req,) = op.add(NewRequest("r", None, [1, 2], SamplingParams(output_kind=kind, **params), 0, time.time()))
        req.logprobs, req.prompt_logprobs = [], [{2: (-0.5, 1)}]
        req.sampling_masks = []
        outs = []
        for t in tokens:
            req.output_token_ids.append(t)
            req.logprobs.append({t: (-1.0, 2), 0: (-0.1, 1)})
            req.sampling_masks.append([0, t])
            stop = watcher.update(req) if watcher.watches(req) else None
            if stop is not None:
                req.finish_reason, req.stop_reason = "stop", stop
            elif len(req.output_token_ids) == len(tokens):
                req.finish_reason = "length"
            outs += [o for _, o in op.process([req])]
            if req.finish_reason:
                watcher.forget(req.request_id)
                break
        runs[kind] = outs
    return runs


def joined(outs: list[RequestOutput]) -> RequestOutput:
    first = outs[0]
    for o in outs[1:]:
        first.add(o, aggregate=True)
    return first


def test_deltas_hold_back_the_start_of_a_stop_string_until_it_cannot_be_one(inputs):
    runs = stream(inputs, b"xab", stop=["ab"])
    assert [o.outputs[0].text for o in runs[RequestOutputKind.DELTA]] == ["x", "", ""]
    assert runs[RequestOutputKind.FINAL_ONLY][0].outputs[0].text == "x"
    runs = stream(inputs, b"xaaca", stop=["aab", "zz"])  # "a", then "aa", may begin "aab"; "c" ends that
    assert [o.outputs[0].text for o in runs[RequestOutputKind.DELTA]] == ["x", "", "", "aac", "a"]
    assert [o.outputs[0].text for o in runs[RequestOutputKind.CUMULATIVE]] == ["x", "x", "x", "xaac", "xaaca"]
    runs = stream(inputs, b"xab", stop=["ab"], include_stop_str_in_output=True)  # nothing to drop
    assert [o.outputs[0].text for o in runs[RequestOutputKind.DELTA]] == ["x", "a", "b"]


def test_a_character_split_across_tokens_is_held_until_whole(inputs):
    runs = stream(inputs, "xé!".encode())  # é: two byte tokens
    assert [o.outputs[0].text for o in runs[RequestOutputKind.CUMULATIVE]] == ["x", "x", "xé", "xé!"]
    assert [o.outputs[0].text for o in runs[RequestOutputKind.DELTA]] == ["x", "", "é", "!"]


@pytest.mark.parametrize("seed", range(40))
def test_streams_join_into_the_final_output(inputs, seed):
    rng = random.Random(seed)
    tokens = bytes(rng.choice(b"ab.\n") for _ in range(rng.randint(1, 24)))
    stops = [bytes(rng.choice(b"ab.") for _ in range(rng.randint(1, 4))).decode() for _ in range(rng.randint(1, 3))]
    runs = stream(inputs, tokens, stop=stops, include_stop_str_in_output=rng.random() < 0.3,
                  min_tokens=min(len(tokens), rng.choice([0, 0, 3])), prompt_logprobs=1, return_sampling_mask=True)
    (final,) = runs[RequestOutputKind.FINAL_ONLY]
    texts = [o.outputs[0].text for o in runs[RequestOutputKind.CUMULATIVE]]
    assert texts[-1] == final.outputs[0].text
    assert all(final.outputs[0].text.startswith(t) for t in texts), (tokens, stops, texts)
    # As vLLM's: the prompt logprobs come once, in the first DELTA output (add() keeps the first's).
    assert runs[RequestOutputKind.DELTA][0].prompt_logprobs == final.prompt_logprobs
    assert all(o.prompt_logprobs == [] for o in runs[RequestOutputKind.DELTA][1:])
    delta = joined(runs[RequestOutputKind.DELTA])
    c, f = delta.outputs[0], final.outputs[0]
    assert (c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason) == (
        f.text, f.token_ids, f.logprobs, f.finish_reason, f.stop_reason), (tokens, stops)
    assert c.sampling_mask == f.sampling_mask and delta.prompt_logprobs == final.prompt_logprobs
    assert delta.finished and c.cumulative_logprob == pytest.approx(-1.0 * len(f.token_ids))


def test_held_back_is_the_longest_end_that_begins_a_stop_string():
    assert held_back("xyzab", ["abc", "bd"]) == 2
    assert held_back("xyzb", ["abc", "bd"]) == 1
    assert held_back("xyz", ["abc"]) == 0
    assert held_back("aba", ["ab"]) == 1
    assert held_back("ab", ["ab"]) == 0  # a whole stop string is found, never held
    assert held_back("", ["abc"]) == 0


def test_output_classes_take_vllms_arguments_in_vllms_order():
    # vLLM 0.34's CompletionOutput fields and RequestOutput.__init__ parameters, in order.
    assert [f.name for f in dataclasses.fields(CompletionOutput)] == [
        "index", "text", "token_ids", "cumulative_logprob", "logprobs", "routed_experts", "finish_reason",
        "stop_reason", "lora_request", "sampling_mask", "spec_decode_metrics", "weight_versions"]
    params = list(inspect.signature(RequestOutput.__init__).parameters.values())[1:]
    assert [p.name for p in params] == [
        "request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs", "finished", "metrics",
        "lora_request", "encoder_prompt", "encoder_prompt_token_ids", "num_cached_tokens",
        "num_cache_creation_tokens", "prompt_token_id_logprobs", "kv_transfer_params", "ec_transfer_params",
        "weight_version", "kwargs"]
    assert [p.kind for p in params[12:16]] == [inspect.Parameter.KEYWORD_ONLY] * 4
    c = CompletionOutput(0, "hi", [104, 105], -1.5, None, None, "length")
    out = RequestOutput("r", "p", [1], None, [c], True)
    assert (c.cumulative_logprob, c.finish_reason, out.outputs, out.finished, out.metrics) == (
        -1.5, "length", [c], True, None)
    assert RequestOutput("r", None, [1], None, [], False, some_newer_field=1).finished is False


def test_metrics_carry_vllms_names(inputs):
    (final,) = stream(inputs, b"abc")[RequestOutputKind.FINAL_ONLY]
    m = final.metrics
    assert isinstance(m, RequestStateStats)
    names = [f.name for f in dataclasses.fields(RequestStateStats)][:11]
    assert names == ["num_generation_tokens", "num_preemptions", "arrival_time", "queued_ts", "scheduled_ts",
                     "first_token_ts", "last_token_ts", "first_token_latency", "is_corrupted", "is_watermarked",
                     "is_watermark_skipped"]
    assert (m.num_generation_tokens, m.num_preemptions, m.num_prompt_tokens) == (3, 0, 2)
    assert m.queued_ts == m.arrival_time > 0 and m.finished_time >= m.arrival_time
    # No core stamped these here: vLLM's 0.0, and None under this engine's older names.
    assert (m.scheduled_ts, m.first_token_ts, m.first_token_latency) == (0.0, 0.0, 0.0)
    assert (m.first_scheduled_time, m.first_token_time, m.time_in_queue) == (None, None, None)
    m.scheduled_ts, m.first_token_ts = m.arrival_time + 1, m.arrival_time + 2
    assert (m.time_in_queue, m.first_token_time) == (1, m.arrival_time + 2)
