"""Structured outputs through `LLM.generate` / `chat` (docs/structured-outputs.md): every sampled
token obeys the request's JSON schema, regex, choice or grammar, checked by independent means
(jsonschema, Python's re, set membership), with the bundled byte-level model and with a
byte-level BPE tokenizer (multi-byte tokens); the mask switched off must be seen to fail. Then
the engine paths: preemption, prefix caching, async scheduling, abort, batch-invariant mode,
min_tokens and max_tokens, a refused constraint; and the layouts (mp TP2 x PP2, torchrun
TP2 x DP2) against uni, token for token; run_batch's response_format uni and torchrun TP2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from launch import PYTHON, run_torchrun
from structured import CHOICES, SCHEMA, check_samples, structured_params

from spmd_engine import LLM, SamplingParams
from spmd_engine.config import ConfigError
from spmd_engine.sampling_params import StructuredOutputsParams

pytest.importorskip("xgrammar")  # the test extra installs it; CI runs with it

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "tests" / "helpers" / "dist_scripts" / "structured_layouts.py"


@pytest.fixture(scope="module")
def bundled():
    with LLM(seed=0, max_model_len=512) as llm:
        yield llm


def test_every_constraint_holds_on_the_bundled_model(bundled):
    check_samples(bundled, None, "Beautiful is", 16)


def test_chat_and_greedy_choice_and_stop_reason(bundled):
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    so = StructuredOutputsParams(choice=CHOICES)
    out = bundled.chat([{"role": "user", "content": "Flat is"}], SamplingParams(temperature=0.0, structured_outputs=so),
                       chat_template=template)[0].outputs[0]
    assert out.text in CHOICES and out.finish_reason == "stop" and out.stop_reason is None


def test_min_tokens_yields_where_the_grammar_can_only_end_and_max_tokens_cuts(bundled):
    so = StructuredOutputsParams(choice=["ab"])
    out = bundled.generate("Flat is", SamplingParams(temperature=0.0, min_tokens=10, max_tokens=20,
                                                     structured_outputs=so))[0].outputs[0]
    assert (out.text, out.finish_reason) == ("ab", "stop")
    out = bundled.generate("Flat is", SamplingParams(temperature=1.0, seed=1, max_tokens=5,
                                                     structured_outputs={"json": SCHEMA}))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5 and out.text.startswith("{")


def test_a_refused_constraint_fails_its_call_with_the_backends_message_and_nothing_else(bundled):
    good = [structured_params("date", s) for s in range(4)]
    before = [o.outputs[0].text for o in bundled.generate(["Flat is"] * 4, good)]
    for bad, message in (({"regex": "([a-"}, r"prompt 1: structured_outputs.regex was refused by xgrammar: "
                                             r"Regex parsing error"),
                         ({"json": {"type": "objec"}}, 'Unsupported type "objec"')):
        with pytest.raises(ConfigError, match=message):
            bundled.generate(["Flat is"] * 2, [good[0], SamplingParams(structured_outputs=bad)])
    with pytest.raises(ConfigError, match="only one constraint may be set, got json, regex"):
        SamplingParams(structured_outputs={"json": SCHEMA, "regex": "a"})
    assert [o.outputs[0].text for o in bundled.generate(["Flat is"] * 4, good)] == before
    assert _core(bundled).structured.tracks == {}


def test_abort_frees_the_matcher(bundled):
    engine = bundled.llm_engine
    engine.add_request("so-abort", "Flat is", structured_params("json", 0))
    engine.add_request("so-run", "Flat is", structured_params("date", 0))
    engine.step()
    engine.abort_request(["so-abort"])
    while engine.has_unfinished_requests():
        engine.step()
    assert _core(bundled).structured.tracks == {}


def _core(llm):
    """The EngineCore of a one-process engine."""
    return llm.llm_engine._client.engine_core


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_200_samples_per_constraint_on_the_bundled_model(bundled):
    check_samples(bundled, None, "Beautiful is", 200)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_mp_tp2_pp2_gives_the_tokens_of_uni(bundled):
    prompts = ["Beautiful is", "Flat is", "Errors should", "Now is"] * 2
    params = [structured_params(n, s) for s, n in enumerate(["json", "date", "choice", "grammar", "email", "json",
                                                  "date", "json"])]
    reference = [o.outputs[0].token_ids for o in bundled.generate(prompts, params)]
    with LLM(seed=0, max_model_len=512, tensor_parallel_size=2, pipeline_parallel_size=2,
             distributed_executor_backend="mp") as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == reference


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_dp_waves_of_a_mixture_of_experts_give_the_tokens_of_one_worker(bundled, tmp_path):
    """A Qwen3-MoE (byte tokenizer) under DP 2 (mp): its replicas step in waves, the one with
    fewer constrained requests running dummy forwards; every request's tokens equal one worker's
    and obey their constraint."""
    from make_random_checkpoint import make_random_checkpoint
    from structured import CONSTRAINTS
    model = make_random_checkpoint(tmp_path / "moe", architecture="Qwen3MoeForCausalLM", hidden_size=64, num_layers=2,
                                   num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96, vocab_size=258,
                                   num_experts=4, num_experts_per_tok=2, seed=3)
    config = json.loads((model / "config.json").read_text())
    config.update(spmd_engine_tokenizer="bytes", bos_token_id=256, eos_token_id=257)
    (model / "config.json").write_text(json.dumps(config))
    names = ["date", "choice", "grammar", "email", "json"]
    prompts = ["Beautiful is", "Flat is", "Errors should", "Now is", "Simple is"]
    params = [structured_params(n, s) for s, n in enumerate(names)]
    for p in params:
        p.max_tokens = 60  # a random model seldom closes a schema: a length finish is fine here
    # one worker process (mp): this module's `bundled` engine holds this process's default group
    with LLM(model=str(model), seed=0, max_model_len=512, distributed_executor_backend="mp") as one:
        reference = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    with LLM(model=str(model), seed=0, max_model_len=512, data_parallel_size=2,
             distributed_executor_backend="mp") as llm:
        assert llm.dp_waves
        outs = llm.generate(prompts, params)
        stats = llm.get_stats()
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert any(s["dummy_steps"] > 0 for s in stats) or len({s["steps"] for s in stats}) == 1
    for o, n in zip(outs, names):
        if o.outputs[0].finish_reason == "stop":
            assert CONSTRAINTS[n][1](o.outputs[0].text), (n, o.outputs[0].text)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.xdist_group("world4")
def test_torchrun_tp2_dp2_gives_the_tokens_of_uni(bundled, tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    from structured_layouts import PROMPTS, params
    reference = [o.outputs[0].token_ids for o in bundled.generate(PROMPTS, params())]
    launch = run_torchrun(4, [SCRIPT, tmp_path], timeout=380, env_extra={"OMP_NUM_THREADS": "1"})
    assert launch.returncode == 0 and not launch.timed_out, launch.describe()
    assert not launch.leftover_pids
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert len(results) == 4
    for r in results:  # every rank, of either replica, saw every request (its engine ran them all)
        assert r["tokens"] == reference, r["rank"]


NO_SPACE = {str(b): -100 for b in b" \n\t\r"}  # the byte model's whitespace: response_format has no switch for it
BATCH = [
    {"custom_id": "schema", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "Simple is", "max_tokens": 200, "temperature": 1.0, "seed": 1, "logit_bias": NO_SPACE,
              "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}}},
    {"custom_id": "bad", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "Simple is", "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objec"}}}}},
    {"custom_id": "object", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "Simple is"}], "max_tokens": 300, "temperature": 1.0, "seed": 2,
              "response_format": {"type": "json_object"}, "logit_bias": {"34": 10, "125": 6, **NO_SPACE}}},
    {"custom_id": "choice", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "Flat is", "temperature": 1.0, "seed": 3, "structured_outputs": {"choice": CHOICES}}},
]


def _run_batch(tmp_path: Path, torchrun: bool) -> dict:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in BATCH))
    (tmp_path / "chat.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    args = ["-i", src, "-o", out, "--chat-template", tmp_path / "chat.jinja", "--quiet"]
    if torchrun:
        launch = run_torchrun(2, ["-m", "spmd_engine.run_batch", "-tp", "2", *args], timeout=280,
                              env_extra={"OMP_NUM_THREADS": "1"})
        assert launch.returncode == 0 and not launch.timed_out, launch.describe()
        assert not launch.leftover_pids
    else:
        run = subprocess.run([PYTHON, "-m", "spmd_engine.run_batch", *map(str, args)], capture_output=True,
                             text=True, timeout=200)
        assert run.returncode == 0, run.stderr
    return {r["custom_id"]: r["response"] for r in map(json.loads, out.read_text().splitlines())}


def _check_batch(results: dict) -> None:
    import jsonschema
    assert results["bad"]["status_code"] == 400
    assert 'Unsupported type \\"objec\\"' in json.dumps(results["bad"]["body"]["error"]["message"])
    jsonschema.validate(json.loads(results["schema"]["body"]["choices"][0]["text"]), SCHEMA)
    assert isinstance(json.loads(results["object"]["body"]["choices"][0]["message"]["content"]), dict)
    assert results["choice"]["body"]["choices"][0]["text"] in CHOICES


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.xdist_group("world4")
def test_run_batch_response_format_uni_and_torchrun_tp2(tmp_path):
    uni = _run_batch(tmp_path / "uni", torchrun=False) if (tmp_path / "uni").mkdir() is None else None
    _check_batch(uni)
    tp2 = _run_batch(tmp_path / "tp2", torchrun=True) if (tmp_path / "tp2").mkdir() is None else None
    _check_batch(tp2)
    for key in ("schema", "object", "choice"):  # the same text on either layout
        assert json.dumps(uni[key]["body"]["choices"]) == json.dumps(tp2[key]["body"]["choices"])


def test_prompts_file_lines_carry_their_own_constraint(tmp_path):
    lines = [{"prompt": "Beautiful is", "structured_outputs": {"choice": CHOICES}}, {"prompt": "Errors should"},
             {"prompt": "Flat is", "structured_outputs": {"regex": "[0-9]{3}"}}]
    src, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    run = subprocess.run([sys.executable, "-m", "spmd_engine.run", "--prompts-file", str(src), "--max-tokens", "12",
                          "--output", str(out), "--quiet"], capture_output=True, text=True, timeout=200)
    assert run.returncode == 0, run.stderr
    texts = [json.loads(x)["text"] for x in out.read_text().splitlines()]
    assert texts[0] in CHOICES and texts[1] == " never pass " and len(texts[2]) == 3 and texts[2].isdigit()
