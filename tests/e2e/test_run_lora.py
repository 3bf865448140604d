"""LoRA adapters through both command lines: `--enable-lora --lora-modules name=path ...`, each
prompts-file line choosing one by `"lora"` (or `"model"`), each batch request by its body's
`"model"`, as vLLM's server does.

Two PEFT adapters of the bundled model (different seeds and ranks) that change its greedy text;
each line's tokens are compared with transformers + PEFT's greedy decode of that line's adapter
(or of no adapter), so a name ignored or mixed up gives another adapter's tokens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from launch import REPO, run_checked, run_torchrun

BUNDLED = REPO / "spmd_engine" / "bundled"
MAX_TOKENS = 16
PROMPT = "Simple is"
TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


def cli(module, *args, timeout=100):
    return run_checked([sys.executable, "-m", module, *args], module.rsplit(".", 1)[1], timeout)


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    """Adapters a1 (r 8) and a2 (r 16), their flags, and the reference greedy tokens of PROMPT
    (with the bundled model's BOS) under each and under the base model."""
    from conftest import require_reference
    require_reference("peft")
    require_reference("transformers")
    from lora_helpers import make_adapter, peft_model, reference_greedy
    from transformers import AutoModelForCausalLM
    root = tmp_path_factory.mktemp("lora")
    dirs = {"a1": make_adapter(BUNDLED, root / "a1", seed=1, scale=0.7),
            "a2": make_adapter(BUNDLED, root / "a2", r=16, alpha=32, seed=2, scale=0.7)}
    ids = [256, *PROMPT.encode()]
    models = {name: peft_model(BUNDLED, path) for name, path in dirs.items()}
    models[None] = AutoModelForCausalLM.from_pretrained(str(BUNDLED)).eval()
    refs = {name: reference_greedy(model, ids, MAX_TOKENS) for name, model in models.items()}
    assert len({tuple(t) for t in refs.values()}) == 3, refs  # each adapter changes the text, differently
    flags = ["--enable-lora", "--lora-modules", f"a1={dirs['a1']}",
             json.dumps({"name": "a2", "path": str(dirs["a2"])})]
    return {"dirs": dirs, "refs": refs, "flags": flags, "root": root}


@pytest.fixture(scope="module")
def prompts_file(lora):
    lines = [{"prompt": PROMPT, "lora": "a1"}, {"prompt": PROMPT}, {"prompt": PROMPT, "model": "a2"},
             {"prompt": PROMPT, "model": "bundled"}]
    path = lora["root"] / "prompts.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def check_run_records(records, refs):
    assert [r["token_ids"] for r in records] == [refs["a1"], refs[None], refs["a2"], refs[None]]
    assert [r.get("lora") for r in records] == ["a1", None, "a2", None]
    assert "lora" not in records[1] and "lora" not in records[3]  # base lines keep the plain record


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.mark.timeout(120)
def test_run_lines_choose_their_adapter(lora, prompts_file, tmp_path):
    out = tmp_path / "out.jsonl"
    proc = cli("spmd_engine.run", *lora["flags"], "--prompts-file", prompts_file, "--max-tokens", MAX_TOKENS,
               "--output", out, "--quiet")
    assert proc.returncode == 0, proc.stderr
    check_run_records(read_jsonl(out), lora["refs"])


@pytest.mark.timeout(150)
def test_run_under_torchrun_tp2_serves_the_adapters(lora, prompts_file, tmp_path):
    out = tmp_path / "out.jsonl"
    launch = run_torchrun(2, ["-m", "spmd_engine.run", "-tp", 2, *lora["flags"], "--prompts-file", prompts_file,
                              "--max-tokens", MAX_TOKENS, "--output", out, "--quiet"], timeout=140)
    assert launch.returncode == 0, launch.describe()
    check_run_records(read_jsonl(out), lora["refs"])
    assert not launch.leftover_pids


@pytest.mark.timeout(120)
def test_run_batch_model_field_chooses_the_adapter(lora, tmp_path):
    common = {"max_tokens": MAX_TOKENS, "temperature": 0}
    bodies = [("/v1/completions", {"model": "a1", "prompt": PROMPT}),
              ("/v1/completions", {"prompt": PROMPT}),
              ("/v1/chat/completions", {"model": "a2", "messages": [{"role": "user", "content": PROMPT}]}),
              ("/v1/completions", {"model": "nope", "prompt": PROMPT}),
              ("/v1/completions", {"model": "bundled", "prompt": PROMPT})]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps({"custom_id": str(i), "method": "POST", "url": url,
                                            "body": {**body, **common}}) + "\n" for i, (url, body) in enumerate(bodies)))
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)  # the conversation renders to the same text, without BOS
    out = tmp_path / "results.jsonl"
    proc = cli("spmd_engine.run_batch", *lora["flags"], "-i", requests, "-o", out, "--chat-template", template,
               "--quiet")
    assert proc.returncode == 0, proc.stderr
    results = read_jsonl(out)
    texts = [r["response"]["body"]["choices"][0].get("text") for r in results if r["error"] is None]
    assert texts[0] == decode(lora["refs"]["a1"]) and texts[1] == texts[3] == decode(lora["refs"][None])
    chat = results[2]["response"]["body"]
    assert chat["model"] == "a2" and results[0]["response"]["body"]["model"] == "a1"
    assert results[4]["response"]["body"]["model"] == "bundled"
    from lora_helpers import peft_model, reference_greedy
    chat_ref = reference_greedy(peft_model(BUNDLED, lora["dirs"]["a2"]), list(PROMPT.encode()), MAX_TOKENS)
    assert chat["choices"][0]["message"]["content"] == decode(chat_ref)
    message = "The model `nope` does not exist. Valid aliases: bundled."
    assert results[3]["response"]["status_code"] == 404
    assert results[3]["response"]["body"] == {"error": {"message": message, "type": "NotFoundError",
                                                        "param": "model", "code": 404}}
    assert results[3]["error"] == {"code": "model_not_found", "message": message}


def decode(ids):
    """The byte-level tokenizer's text of ids below 256 (the references' are ASCII: checked)."""
    assert all(t < 128 for t in ids), ids
    return bytes(ids).decode("ascii")


def one_error_line(proc, needle):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr
    assert proc.stdout == ""


def bad_case(name, lora, tmp_path):
    """(module, args, the error line's text) of one kind of bad LoRA input."""
    a1, a2 = lora["dirs"]["a1"], lora["dirs"]["a2"]
    lines = tmp_path / "p.jsonl"
    lines.write_text('{"prompt": "x"}\n{"prompt": "y", "lora": "zz"}\n')
    model_line = tmp_path / "m.jsonl"
    model_line.write_text('{"prompt": "y", "model": "zz"}\n')
    (tmp_path / "empty").mkdir()
    run, batch = "spmd_engine.run", "spmd_engine.run_batch"
    return {
        "unknown-lora-name": (run, ["--enable-lora", "--lora-modules", f"a1={a1}", "--prompts-file", lines],
                              f"{lines}:2: \"lora\": unknown LoRA adapter 'zz' (--lora-modules gives: a1)"),
        "unknown-model-name": (run, ["--enable-lora", "--lora-modules", f"a1={a1}", "--prompts-file", model_line],
                               f"{model_line}:1: \"model\": unknown LoRA adapter 'zz' (--lora-modules gives: a1)"),
        "lora-without-modules": (run, ["--prompts-file", lines],
                                 f"{lines}:2: \"lora\": unknown LoRA adapter 'zz' (no --lora-modules given)"),
        "entry-without-path": (run, ["--enable-lora", "--lora-modules", "a1"],
                               "--lora-modules: 'a1' is neither name=path nor a JSON object"),
        "json-without-path": (run, ["--enable-lora", "--lora-modules", '{"name": "a1"}'], "needs a non-empty path"),
        "no-enable-lora": (run, ["--lora-modules", f"a1={a1}"], "--lora-modules needs --enable-lora"),
        "batch-no-enable-lora": (batch, ["-i", lines, "-o", tmp_path / "o.jsonl", "--lora-modules", f"a1={a1}"],
                                 "--lora-modules needs --enable-lora"),
        "not-an-adapter": (run, ["--enable-lora", "--lora-modules", f"a1={tmp_path / 'empty'}"],
                           f"--lora-modules: LoRA adapter 'a1': {tmp_path / 'empty'}/adapter_config.json is missing"),
        "rank-too-high": (run, ["--enable-lora", "--lora-modules", f"a2={a2}", "--max-lora-rank", "8"],
                          "--lora-modules: LoRA adapter 'a2': LoRA rank 16 is greater than max_lora_rank 8."),
        "not-a-rank": (run, ["--enable-lora", "--max-lora-rank", "12"], "argument --max-lora-rank: invalid choice: 12"),
    }[name]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["unknown-lora-name", "unknown-model-name", "lora-without-modules",
                                  "entry-without-path", "json-without-path", "no-enable-lora",
                                  "batch-no-enable-lora", "not-an-adapter", "rank-too-high", "not-a-rank"])
def test_bad_lora_input_is_one_line_and_exit_2(name, lora, tmp_path):
    module, args, needle = bad_case(name, lora, tmp_path)
    one_error_line(cli(module, *args), needle)


@pytest.mark.timeout(120)
def test_bad_adapter_under_torchrun_ends_every_rank(lora, tmp_path):
    launch = run_torchrun(2, ["-m", "spmd_engine.run", "-tp", 2, "--enable-lora", "--lora-modules",
                              f"a1={tmp_path / 'missing'}"], timeout=100)
    assert not launch.timed_out and launch.returncode == 1, launch.describe()
    assert "(exitcode: 2)" in launch.stderr, launch.describe()
    assert launch.stderr.count("error: --lora-modules: LoRA adapter 'a1': no adapter directory at") == 1
    assert not launch.leftover_pids
