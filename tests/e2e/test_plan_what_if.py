"""`plan --device cuda --gpu-memory SIZE` from a config.json alone: will it fit, and how much KV is left?

The references are by hand: parameter counts from the public sizes of Llama-3-70B and
Qwen3-235B-A22B (70,553,706,496 and about 235 billion), the TP shard of each tensor as
vLLM cuts it (the vocabulary padded to a multiple of 64 x TP), and the CUDA budget rule
of docs/memory-model.md. Bad input is one line on stderr and exit 2.
"""

import contextlib
import io
import json
import re
import subprocess
import sys

import pytest
from launch import REPO

from spmd_engine.plan.main import main as plan_main

GiB = 1 << 30
LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "num_hidden_layers": 80,
             "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 28672,
             "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0,
             "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}
QWEN3_235B = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 94,
              "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 12288,
              "moe_intermediate_size": 1536, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
              "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
              "torch_dtype": "bfloat16"}
WHAT_IF = ["--device", "cuda", "--gpu-memory", "80GiB", "--max-model-len", "32768"]


def config_dir(tmp_path, name: str, config: dict):
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(json.dumps(config))
    return tmp_path / name


def plan(*args) -> tuple[int, dict | None, str]:
    """`plan --json` in this process: (exit code, the memory object, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = plan_main([*map(str, args), "--json"])
        except SystemExit as exc:  # argparse's errors
            rc = exc.code
    memory = json.loads(out.getvalue()).get("memory") if out.getvalue() else None
    return rc, memory, err.getvalue()


def llama_rank_bytes(c: dict, tp: int, itemsize: int = 2) -> int:
    """One TP rank of a whole (PP 1) dense Llama, counted by hand."""
    h, d = c["hidden_size"], c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d // tp, max(1, c["num_key_value_heads"] // tp) * d
    multiple = 64 * tp // __import__("math").gcd(64, tp)
    rows = -(-c["vocab_size"] // multiple) * multiple // tp
    layer = h * (q + 2 * kv) + q * h + 3 * h * c["intermediate_size"] // tp + 2 * h
    return (2 * rows * h + c["num_hidden_layers"] * layer + h) * itemsize


def test_hand_count_is_the_public_size():
    assert llama_rank_bytes(LLAMA_70B, 1) == 2 * 70_553_706_496


@pytest.mark.timeout(60)
def test_llama_70b_on_80gib_cards(tmp_path):
    model = config_dir(tmp_path, "llama70b", LLAMA_70B)
    for tp in (4, 8):
        rc, memory, _ = plan("--model", model, *WHAT_IF, "-tp", tp)
        assert rc == 0 and memory["fits"], memory["verdict"]
        assert {r["weight_bytes"] for r in memory["per_rank"]} == {llama_rank_bytes(LLAMA_70B, tp)}
        rank = memory["per_rank"][0]
        # kv_sizing's CUDA rule: 0.9 of the card less weights, activations and a 256 MiB reserve.
        budget = int(0.9 * 80 * GiB) - rank["weight_bytes"] - rank["activation_bytes"] - (256 << 20)
        per_token = 2 * 80 * (8 // tp or 1) * 128 * 2
        assert rank["kv_blocks"] == budget // (16 * per_token)
        assert rank["max_concurrent_seqs"] == rank["kv_blocks"] * 16 // 32768 > 0
        assert memory["verdict"].startswith(f"fits: TP={tp} x PP=1 on {tp} GPUs of 80 GiB")
    rc, memory, err = plan("--model", model, *WHAT_IF, "-tp", 2)
    assert rc == 2 and not memory["fits"]
    # The weights fit (2 x 65.7 GiB), but what is left holds less than one 32k sequence.
    assert memory["verdict"].startswith("does not fit: TP=2 x PP=1") and "the KV cache left holds" in err
    assert "tokens per rank, fewer than one sequence of max_model_len 32768" in err
    # 3 GPUs: TP 3 does not divide 64 heads, PP 3 (27 + 27 + 26 layers) leaves room for the KV cache.
    assert memory["verdict"].endswith("the smallest that fits: TP=1 x PP=3"), memory["verdict"]
    assert err.count("\n") == 1 and err.startswith("error: does not fit: ")


@pytest.mark.timeout(60)
def test_qwen3_235b_a22b_on_80gib_cards(tmp_path):
    model = config_dir(tmp_path, "qwen235b", QWEN3_235B)
    rc, memory, _ = plan("--model", model, "--device", "cuda", "--gpu-memory", "1TiB")
    total = memory["per_rank"][0]["weight_bytes"]
    assert 234.5e9 < total / 2 < 235.5e9  # bf16 parameters: the public 235B
    layouts = {"tp8": ["-tp", 8], "tp8-ep": ["-tp", 8, "--enable-expert-parallel"], "tp4": ["-tp", 4],
               "tp8-pp2": ["-tp", 8, "-pp", 2]}
    memories = {}
    for name, flags in layouts.items():
        rc, memories[name], _ = plan("--model", model, *WHAT_IF, *flags)
        assert rc == (0 if memories[name]["fits"] else 2)
        ranks = 16 if name == "tp8-pp2" else 8 if name.startswith("tp8") else 4
        assert all(r["weight_bytes"] * ranks >= total for r in memories[name]["per_rank"])
    assert {name: m["fits"] for name, m in memories.items()} == {"tp8": True, "tp8-ep": True, "tp4": False,
                                                                  "tp8-pp2": True}
    # 16 whole experts a rank under EP hold the bytes of TP 8's eighth of every expert.
    assert memories["tp8-ep"]["per_rank"] == memories["tp8"]["per_rank"]
    assert "the smallest that fits: TP=1 x PP=7" in memories["tp4"]["verdict"]


@pytest.mark.timeout(60)
def test_a_config_json_alone_works_from_the_command_line(tmp_path):
    model = config_dir(tmp_path, "llama70b", LLAMA_70B)
    proc = subprocess.run([sys.executable, "-m", "spmd_engine.plan", "--model", str(model / "config.json"),
                           "-tp", "8", *WHAT_IF], capture_output=True, text=True, timeout=50, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "fits: TP=8 x PP=1 on 8 GPUs of 80 GiB (1 node of 8)" in proc.stdout
    assert "measured on the device" not in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "spmd_engine.plan", "--model", str(model), "--device", "cuda"],
                          capture_output=True, text=True, timeout=50, cwd=REPO)
    assert proc.returncode == 0 and "give --gpu-memory SIZE to plan it here" in proc.stdout, proc.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("config, flags, needle", [
    ({**LLAMA_70B, "architectures": ["GPT2LMHeadModel"]}, WHAT_IF, "unsupported architecture GPT2LMHeadModel"),
    (LLAMA_70B, ["--device", "cuda", "--gpu-memory", "80GiB", "-tp", "1"],
     "does not fit: TP=1 x PP=1 on 1 GPUs of 80 GiB (1 node of 8): rank 0 needs 131.42 GiB of weights"),
    (LLAMA_70B, ["--device", "cuda", "--gpu-memory", "80G"], "--gpu-memory '80G' is not a size"),
    (LLAMA_70B, ["--gpu-memory", "80GiB"], "--gpu-memory plans GPU ranks: add --device cuda"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, config, flags, needle):
    rc, _, err = plan("--model", config_dir(tmp_path, "m", config), *flags)
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: ") and needle in err, err


def test_the_docs_configs_are_these_shapes():
    for name, config in (("llama-3-70b", LLAMA_70B), ("qwen3-235b-a22b", QWEN3_235B)):
        assert json.loads((REPO / "docs" / "configs" / name / "config.json").read_text()) == config


@pytest.mark.timeout(120)
def test_the_readme_table_is_what_plan_says():
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in
            (REPO / "README.md").read_text().splitlines() if line.startswith(("| Llama-3-70B", "| Qwen3-235B"))]
    assert len(rows) == 8
    for model, layout, weights, tokens, seqs, verdict in rows:
        sizes = dict(re.findall(r"(TP|PP) (\d+)", layout))
        flags = ["-tp", sizes["TP"], "-pp", sizes.get("PP", "1")]
        name = "llama-3-70b" if model == "Llama-3-70B" else "qwen3-235b-a22b"
        for ep in ([], ["--enable-expert-parallel"]) if "EP or not" in layout else ([],):
            rc, memory, _ = plan("--model", REPO / "docs" / "configs" / name, *WHAT_IF, *flags, *ep)
            fullest = max(r["weight_bytes"] for r in memory["per_rank"])
            got = [f"{fullest / GiB:.2f} GiB", str(memory["per_rank"][0]["kv_tokens"]),
                   str(memory["per_rank"][0]["max_concurrent_seqs"]), memory["fits"]]
            assert got == [weights, tokens, seqs, verdict.startswith("fits")], (model, layout)
            smallest = memory["verdict"].rsplit("the smallest that fits: ", 1)[1]
            assert ("the fewest GPUs" in verdict) == (smallest == f"TP={flags[1]} x PP={flags[3]}")
