"""`python -m spmd_engine.run` as users launch it: alone, with mp, under torchrun.

The bundled model recites the Zen of Python, so a wrong shard, stage or
replica shows up as visibly wrong text; the output file must be the same
whatever the layout.
"""

from __future__ import annotations

import json
import sys

import pytest
from engine_helpers import make_tiny_checkpoint
from launch import run_checked, run_torchrun
from zen import continuation

RUN = [sys.executable, "-m", "spmd_engine.run"]


def run_cli(*args, timeout=120):
    return run_checked([*RUN, *args], "cli", timeout)


@pytest.fixture(scope="module")
def uni_stdout():
    proc = run_cli("--prompt", "Beautiful is", "--quiet")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.timeout(120)
def test_plain_run_recites_the_training_text(uni_stdout):
    header, body = uni_stdout.split("\n", 1)
    assert header == "=== prompt 0 (stop, 811 tokens)"
    assert body == "Beautiful is" + continuation("Beautiful is") + "\n"


@pytest.mark.timeout(180)
def test_mp_tp2_pp2_prints_the_same_text(uni_stdout):
    """The README's `python -m spmd_engine.run -tp 2 -pp 2 --prompt "Beautiful is"` (mp: 4 workers)."""
    proc = run_cli("-tp", 2, "-pp", 2, "--prompt", "Beautiful is", "--quiet", timeout=160)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == uni_stdout


@pytest.mark.xdist_group("world8")
@pytest.mark.timeout(300)
def test_torchrun_world8_tp2_pp2_dp2_prints_the_same_text(uni_stdout):
    launch = run_torchrun(8, ["-m", "spmd_engine.run", "-tp", 2, "-pp", 2, "-dp", 2,
                              "--prompt", "Beautiful is", "--quiet"], timeout=280)
    assert launch.returncode == 0, launch.describe()
    assert launch.stdout == uni_stdout  # printed once, by global rank 0
    assert not launch.leftover_pids


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    lines = [{"prompt": "Simple is"}, {"prompt": "Errors should"}, {"prompt_token_ids": [256, 70, 108, 97]},
             {"prompt": "Now is"}, {"prompt": "Readability"}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.timeout(300)
def test_output_file_is_the_same_for_every_layout(tmp_path, prompts_file):
    common = ["--prompts-file", prompts_file, "--max-tokens", 24, "--logprobs", 2, "--quiet"]
    outputs = {}
    for name, args in {"uni": [], "mp-tp2-dp2": ["-tp", 2, "-dp", 2]}.items():
        out = tmp_path / f"{name}.jsonl"
        proc = run_cli(*common, *args, "--output", out, timeout=200)
        assert proc.returncode == 0, proc.stderr
        outputs[name] = read_jsonl(out)
    # torchrun world 4 at TP=2 alone: 2 external-DP replicas share the prompts.
    out = tmp_path / "torchrun.jsonl"
    launch = run_torchrun(4, ["-m", "spmd_engine.run", "-tp", 2, *common, "--output", out], timeout=200)
    assert launch.returncode == 0, launch.describe()
    outputs["torchrun-edp2"] = read_jsonl(out)
    for name, records in outputs.items():
        assert strip_logprobs(records) == strip_logprobs(outputs["uni"]), name
        assert_logprobs_close(records, outputs["uni"])
    records = outputs["uni"]
    assert [r["index"] for r in records] == [0, 1, 2, 3, 4]
    assert set(records[0]) == {"index", "prompt", "prompt_token_ids", "token_ids", "text", "finish_reason",
                               "logprobs"}
    assert records[0]["text"] == continuation("Simple is")[:24]
    assert records[2]["prompt"] is None and records[2]["text"] == continuation("Fla")[:24]
    assert all(len(step) >= 2 for step in records[0]["logprobs"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mp-tp2-dp2.jsonl", "torchrun.jsonl", "uni.jsonl"]


def strip_logprobs(records):
    return [{k: v for k, v in r.items() if k != "logprobs"} for r in records]


def assert_logprobs_close(records, reference):
    """Tokens are identical across layouts; logprobs differ only by reduction order."""
    for r, ref in zip(records, reference):
        for step, ref_step in zip(r["logprobs"], ref["logprobs"]):
            assert step.keys() == ref_step.keys()
            assert all(abs(step[k] - ref_step[k]) < 1e-3 for k in step)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, needle", [
    (["-tp", 3], "tensor_parallel_size 3 must divide num_attention_heads 8"),
    (["-pp", 9], "pipeline_parallel_size 9 exceeds num_hidden_layers 8"),
    (["--model", "/nonexistent/model"], "/nonexistent/model"),
    (["--prompt", "x", "--prompts-file", "p.txt"], "not both"),
    (["--temperature", "-1"], "temperature must be a number in [0, 2], got -1.0"),
    (["--top-p", "0"], "top_p must be in (0, 1], got 0.0"),
    (["--max-tokens", "0"], "max_tokens must be an integer >= 1 or None (up to max_model_len), got 0"),
    (["--max-model-len", "4", "--prompt", "Beautiful is"], "prompt 0 has 13 tokens; max_model_len is 4"),
    (["--dtype", "int8"], "invalid choice: 'int8'"),
    (["--pp-partition", "3,3", "-pp", "3"], "has 2 entries but pipeline_parallel_size is 3"),
    (["-dp", "2", "-pcp", "2"], "cannot be combined with data_parallel_size (2)"),
])
def test_bad_input_exits_2_with_one_line(args, needle):
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr
    assert proc.stdout == ""


@pytest.mark.timeout(60)
def test_bad_prompt_files_name_file_and_line(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": oops}\n')
    for path, needle in ((empty, "holds no prompt"), (bad, f"{bad}:2: malformed JSON")):
        proc = run_cli("--prompts-file", path)
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr


@pytest.mark.timeout(60)
def test_unknown_architecture_and_corrupt_weights(tmp_path, tiny):
    import shutil
    ids = tmp_path / "ids.jsonl"
    ids.write_text('{"prompt_token_ids": [1, 2, 3]}\n')
    arch = tmp_path / "arch"
    shutil.copytree(tiny, arch)
    config = json.loads((arch / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (arch / "config.json").write_text(json.dumps(config))
    proc = run_cli("--model", arch, "--prompts-file", ids)
    assert proc.returncode == 2 and "GPT2LMHeadModel" in proc.stderr, proc.stderr
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x00" * 100)
    proc = run_cli("--model", corrupt, "--prompts-file", ids, "--output", tmp_path / "out.jsonl")
    assert proc.returncode == 2 and "model.safetensors" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.timeout(120)
def test_bad_input_under_torchrun_ends_every_rank():
    launch = run_torchrun(2, ["-m", "spmd_engine.run", "-tp", 3], timeout=100)
    # torchrun itself exits 1 when a worker fails (and stops the others); the worker exited 2.
    assert not launch.timed_out and launch.returncode == 1, launch.describe()
    assert "(exitcode: 2)" in launch.stderr, launch.describe()
    assert launch.stderr.count("error: tensor_parallel_size 3 must divide") == 1  # printed by rank 0 only
    assert not launch.leftover_pids


@pytest.mark.timeout(120)
def test_world_size_that_does_not_hold_whole_replicas():
    launch = run_torchrun(3, ["-m", "spmd_engine.run", "-tp", 2], timeout=100)
    assert not launch.timed_out and launch.returncode == 1, launch.describe()
    assert "error: world size 3 is not a multiple of TP x PP x PCP x DP = 2x1x1x1 = 2" in launch.stderr
    assert "(exitcode: 2)" in launch.stderr and not launch.leftover_pids


@pytest.mark.timeout(120)
def test_usage_error_line_survives_a_slow_rank0(tmp_path):
    """Every rank finds the bad layout, only rank 0 prints it: the others must not exit first,
    or the launcher kills rank 0 before it reports. Rank 0 is held back 2 s here, as under
    load; before the fix the error line was missing and torchrun named rank 2's exit."""
    script = tmp_path / "slow_rank0.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ.get('RANK') == '0':\n    time.sleep(2)\n"
                      "from spmd_engine.run.main import main\nsys.exit(main(sys.argv[1:]))\n")
    launch = run_torchrun(3, [script, "-tp", 2], timeout=100)
    assert not launch.timed_out and launch.returncode == 1, launch.describe()
    assert "error: world size 3 is not a multiple of TP x PP x PCP x DP = 2x1x1x1 = 2" in launch.stderr
    assert "(exitcode: 2) local_rank: 0" in launch.stderr and not launch.leftover_pids


@pytest.mark.timeout(120)
def test_logprobs_mode_reaches_the_output_file(tmp_path):
    """--logprobs-mode raw_logits writes the logits (the bundled model's top one is far above 0),
    the default writes logprobs (all <= 0), for the same tokens."""
    records = {}
    for mode in ("raw_logprobs", "raw_logits"):
        out = tmp_path / f"{mode}.jsonl"
        proc = run_cli("--prompt", "Beautiful is", "--max-tokens", "4", "--logprobs", "2",
                       "--logprobs-mode", mode, "--output", str(out), "--quiet")
        assert proc.returncode == 0, proc.stderr
        records[mode] = read_jsonl(out)[0]
    assert records["raw_logprobs"]["token_ids"] == records["raw_logits"]["token_ids"]
    values = {mode: [v for step in r["logprobs"] for v in step.values()] for mode, r in records.items()}
    assert all(v <= 0 for v in values["raw_logprobs"]) and max(values["raw_logits"]) > 1
    bad = run_cli("--prompt", "x", "--logprobs-mode", "processed")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--logprobs-mode" in bad.stderr


@pytest.mark.timeout(120)
def test_processed_logprobs_of_dropped_tokens_are_strict_json(tmp_path):
    """top_k 2 drops all but two tokens, so a top-5 list holds -inf logprobs: the output file
    stays strict JSON (no -Infinity), with vLLM's -9999.0 in their place."""
    out = tmp_path / "out.jsonl"
    proc = run_cli("--prompt", "Beautiful is", "--max-tokens", "3", "--logprobs", "5", "--temperature", "1",
                   "--top-k", "2", "--logprobs-mode", "processed_logprobs", "--output", str(out), "--quiet")
    assert proc.returncode == 0, proc.stderr

    def refuse(name):
        raise AssertionError(f"not strict JSON: {name}")
    (record,) = [json.loads(line, parse_constant=refuse) for line in out.read_text().splitlines()]
    for step in record["logprobs"]:
        values = sorted(step.values(), reverse=True)
        assert values[2:] == [-9999.0] * 3 and all(v > -9999.0 for v in values[:2]), step
