"""`python -m spmd_engine.run_batch`: an OpenAI batch file mixing completions, chat, n=2, stop,
logprobs, seeds and three invalid lines. The valid lines' results equal what the LLM API gives
for the same requests (built here by hand, not by run_batch's parser), the invalid ones get
error results and do not stop the others; the file is the same on uni, mp and torchrun
TP2xDP2, and a run killed mid-way and resumed writes the same bytes. Sampling fields and echo read
from a body change the results as the same SamplingParams do through the LLM API."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from launch import base_env, run_checked, run_torchrun, unique_tag
from part_files import kill_after_records
from zen import continuation

from spmd_engine import LLM, SamplingParams
from spmd_engine.engine.llm import request_seed

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the bundled model has none
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def line(custom_id, url, **body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


# (input line, the LLM call that must give its result: ("generate" | "chat", prompt, params) or None)
CASES = [
    (line("greedy", COMPLETIONS, model="zen", prompt="Beautiful is", max_tokens=16, temperature=0),
     ("generate", "Beautiful is", dict(max_tokens=16, temperature=0))),
    (line("chat-seeded", CHAT, messages=[{"role": "user", "content": "Flat is"}], max_completion_tokens=12,
          temperature=2.0, top_p=0.95, seed=11),
     ("chat", "Flat is", dict(max_tokens=12, temperature=2.0, top_p=0.95, seed=11))),
    (line("bad-url", "/v1/embeddings", input="Simple is"), None),
    (line("n2", COMPLETIONS, prompt="Simple is", max_tokens=12, n=2, temperature=2.0),  # seeded by its line
     ("generate", "Simple is", dict(max_tokens=12, n=2, temperature=2.0, seed=request_seed(0, 3)))),
    (line("stop", COMPLETIONS, prompt="Errors should", max_tokens=24, temperature=0, stop=["pass"]),
     ("generate", "Errors should", dict(max_tokens=24, temperature=0, stop=["pass"]))),
    ('{"custom_id": "broken", "method": "POST", ', None),
    (line("logprobs", COMPLETIONS, prompt="Sparse is", max_tokens=8, temperature=0, logprobs=2),
     ("generate", "Sparse is", dict(max_tokens=8, temperature=0, logprobs=2))),
    (line("chat-logprobs", CHAT, messages=[{"role": "user", "content": "Now is"}], max_tokens=8, temperature=0,
          logprobs=True, top_logprobs=3), ("chat", "Now is", dict(max_tokens=8, temperature=0, logprobs=3))),
    (line("bad-temperature", CHAT, messages=[{"role": "user", "content": "x"}], temperature=5), None),
    (line("seeded", COMPLETIONS, prompt="Readability", max_tokens=12, temperature=2.0, seed=5),
     ("generate", "Readability", dict(max_tokens=12, temperature=2.0, seed=5))),
]
COMMON = ["--chat-template", "TEMPLATE", "--quiet"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    path = tmp_path_factory.mktemp("batch")
    (path / "requests.jsonl").write_text("".join(text + "\n" for text, _ in CASES))
    (path / "chat.jinja").write_text(TEMPLATE)
    return path


def flags(files, out, *extra):
    common = [str(files / "chat.jinja") if f == "TEMPLATE" else f for f in COMMON]
    return ["-m", "spmd_engine.run_batch", "-i", files / "requests.jsonl", "-o", out, *common, *extra]


def run_batch(files, out, *extra, timeout=150):
    return run_checked([sys.executable, *flags(files, out, *extra)], "batch", timeout)


def read(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def uni(files):
    out = files / "uni.jsonl"
    proc = run_batch(files, out, "--max-num-seqs", 1)
    assert proc.returncode == 0, proc.stderr
    return out.read_bytes()


@pytest.fixture(scope="module")
def reference():
    """Each valid line's request through the LLM API, in one process."""
    results = {}
    with LLM() as llm:
        for i, (_, call) in enumerate(CASES):
            if call is None:
                continue
            kind, prompt, params = call
            params = SamplingParams(**params)
            if kind == "chat":
                results[i] = llm.chat([{"role": "user", "content": prompt}], params, chat_template=TEMPLATE)[0]
            else:
                results[i] = llm.generate([prompt], [params])[0]
    return results


@pytest.mark.timeout(200)
def test_results_equal_the_llm_api(uni, reference):
    results = [json.loads(x) for x in uni.decode().splitlines()]
    assert [r["custom_id"] for r in results] == [json.loads(t).get("custom_id") if i != 5 else None
                                                 for i, (t, _) in enumerate(CASES)]  # input order
    for i, result in enumerate(results):
        assert list(result) == ["id", "custom_id", "response", "error"]  # OpenAI's batch output object
        if i not in reference:
            assert result["response"]["status_code"] == 400 and result["error"]["message"], result
            assert result["response"]["body"]["error"]["message"] == result["error"]["message"]
            continue
        out, body = reference[i], result["response"]["body"]
        assert result["error"] is None and result["response"]["status_code"] == 200
        assert body["object"] == ("chat.completion" if CASES[i][1][0] == "chat" else "text_completion")
        texts = [c["message"]["content"] if "message" in c else c["text"] for c in body["choices"]]
        assert texts == [c.text for c in out.outputs], result["custom_id"]
        assert [c["finish_reason"] for c in body["choices"]] == [c.finish_reason for c in out.outputs]
        completion = sum(len(c.token_ids) for c in out.outputs)
        assert body["usage"] == {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": completion,
                                 "total_tokens": len(out.prompt_token_ids) + completion}
        for choice, c in zip(body["choices"], out.outputs):
            if c.logprobs is None:
                assert choice["logprobs"] is None
                continue
            sampled = [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)]
            if "message" in choice:
                entries = choice["logprobs"]["content"]
                assert [e["logprob"] for e in entries] == pytest.approx(sampled, abs=1e-4)
                assert all(len(e["top_logprobs"]) == 3 for e in entries)
            else:
                assert choice["logprobs"]["token_logprobs"] == pytest.approx(sampled, abs=1e-4)
    by_id = {r["custom_id"]: r["response"]["body"] for r in results}
    assert by_id["greedy"]["choices"][0]["text"] == continuation("Beautiful is")[:16]
    assert by_id["greedy"]["model"] == "zen" and by_id["stop"]["model"] == "bundled"
    assert by_id["stop"]["choices"][0] == {"index": 0, "text": " never ", "logprobs": None,
                                           "finish_reason": "stop", "stop_reason": "pass"}
    assert len(by_id["n2"]["choices"]) == 2
    assert "URL '/v1/embeddings'" in by_id["bad-url"]["error"]["message"]
    assert "temperature" in by_id["bad-temperature"]["error"]["message"]


def floats_apart(results):
    """(the results with every float as 0.0, the floats in order): tokens and texts must be
    identical across layouts; logprobs differ only by reduction order."""
    found = []

    def keep(text):
        found.append(float(text))
        return 0.0
    return [json.loads(json.dumps(r), parse_float=keep) for r in results], found


def assert_same_results(results, expected):
    (got, got_floats), (want, want_floats) = floats_apart(results), floats_apart(expected)
    assert got == want
    assert got_floats == pytest.approx(want_floats, abs=1e-3)


@pytest.mark.timeout(400)
def test_same_file_on_mp_and_torchrun_tp2_dp2(files, uni, tmp_path):
    expected = [json.loads(x) for x in uni.decode().splitlines()]
    out = tmp_path / "mp.jsonl"
    proc = run_batch(files, out, "-tp", 2, "-dp", 2, timeout=250)
    assert proc.returncode == 0, proc.stderr
    assert_same_results(read(out), expected)
    out = tmp_path / "torchrun.jsonl"
    launch = run_torchrun(4, [*flags(files, out, "-tp", 2, "-dp", 2)], timeout=250)
    assert launch.returncode == 0 and not launch.leftover_pids, launch.describe()
    assert_same_results(read(out), expected)


@pytest.mark.timeout(300)
def test_resume_after_sigkill_gives_the_same_bytes(files, uni, tmp_path):
    out = tmp_path / "out.jsonl"
    tag = unique_tag("batch-resume")
    # 3 error results at once, then the generated ones, one at a time
    done_before = kill_after_records(flags(files, out, "--max-num-seqs", 1), out, 5, tag)
    assert not out.exists() and 5 <= done_before < len(CASES)
    resumed = run_batch(files, out, "--max-num-seqs", 1, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert out.read_bytes() == uni
    assert not list(tmp_path.glob("out.jsonl.part-*"))


# (custom_id, body fields beyond prompt and max_tokens): each changes what the plain line writes
FIELD_LINES = [
    ("plain", dict(temperature=2.0, seed=5)), ("top_k", dict(temperature=2.0, seed=5, top_k=1)),
    ("logit_bias", dict(temperature=0, logit_bias={"33": 100})),  # "!"
    ("stop_token_ids", dict(temperature=0, stop_token_ids=[116])),  # "t"
    ("min_tokens", dict(temperature=0, stop_token_ids=[116], min_tokens=6)),
    ("echo", dict(temperature=0, echo=True, logprobs=1)),
    ("refused", dict(temperature=0, use_beam_search=True)),
]


@pytest.mark.timeout(300)
def test_request_fields_change_the_outputs(tmp_path):
    """top_k, logit_bias, stop_token_ids, min_tokens and echo read from the body: each line's
    result is the LLM API's for the same SamplingParams, and differs from the plain line's."""
    (tmp_path / "requests.jsonl").write_text("".join(
        line(cid, COMPLETIONS, prompt="Beautiful is", max_tokens=12, **body) + "\n" for cid, body in FIELD_LINES))
    out = tmp_path / "out.jsonl"
    proc = run_checked([sys.executable, "-m", "spmd_engine.run_batch", "-i", tmp_path / "requests.jsonl", "-o", out,
                        "--quiet"], "batch-fields", 150)
    assert proc.returncode == 0, proc.stderr
    got = {r["custom_id"]: r["response"]["body"] for r in read(out)}
    assert got["refused"]["error"]["message"].endswith('"use_beam_search" is not supported by spmd_engine')
    fields = {cid: {k: v for k, v in body.items() if k != "echo"} for cid, body in FIELD_LINES[:-1]}
    fields["echo"]["prompt_logprobs"] = 1
    with LLM() as llm:
        want = {cid: llm.generate(["Beautiful is"], [SamplingParams(max_tokens=12, **f)])[0] for cid, f in fields.items()}
    texts = {cid: body["choices"][0]["text"] for cid, body in got.items() if cid != "refused"}
    assert texts == {cid: ("Beautiful is" if cid == "echo" else "") + o.outputs[0].text for cid, o in want.items()}
    assert texts["top_k"] == continuation("Beautiful is")[:12] != texts["plain"]  # greedy, at temperature 2
    assert texts["logit_bias"] == "!" * 12
    assert (texts["stop_token_ids"], got["stop_token_ids"]["choices"][0]["stop_reason"]) == (" be", 116)
    assert len(want["min_tokens"].outputs[0].token_ids) >= 6 and texts["min_tokens"] != " be"
    echoed = got["echo"]["choices"][0]["logprobs"]["token_logprobs"]
    prompt = [None] + [step[t].logprob for step, t in zip(want["echo"].prompt_logprobs[1:],
                                                             want["echo"].prompt_token_ids[1:])]
    sampled = [step[t].logprob for step, t in zip(want["echo"].outputs[0].logprobs, want["echo"].outputs[0].token_ids)]
    assert echoed[0] is None and echoed[1:] == pytest.approx(prompt[1:] + sampled, abs=1e-4)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, needle", [
    (["-o", "out.jsonl"], "the following arguments are required: -i/--input-file"),
    (["-i", "absent.jsonl", "-o", "out.jsonl"], "--input-file absent.jsonl: no such file"),
    (["-i", "empty.jsonl", "-o", "out.jsonl"], "holds no request"),
    (["-i", "empty.jsonl", "-o", "no/such/dir/out.jsonl"], "its directory does not exist"),
])
def test_usage_errors_exit_2_with_one_line(tmp_path, args, needle):
    (tmp_path / "empty.jsonl").write_text("\n")
    proc = subprocess.run([sys.executable, "-m", "spmd_engine.run_batch", *args], cwd=tmp_path,
                          env=base_env(unique_tag("batch-usage")), capture_output=True, text=True, timeout=50)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and needle in proc.stderr, proc.stderr
