"""Every numeric flag of `run` at 0, negative, huge and non-numeric (issue 25): refused with
exit 2 and one `error:` line naming the flag, before any process starts, or accepted where
the value means something (listed in ACCEPTED, with why)."""

from __future__ import annotations

import pytest
from fuzz_cli import run_checks

NUMERIC = ["--max-tokens", "--temperature", "--top-p", "--top-k", "--logprobs", "--seed", "--max-model-len",
           "--max-num-seqs", "--block-size", "--gpu-memory-utilization", "--kv-cache-memory-bytes",
           "--max-num-batched-tokens", "--tensor-parallel-size", "--pipeline-parallel-size",
           "--data-parallel-size", "--prefill-context-parallel-size", "--decode-context-parallel-size",
           "--nnodes", "--timeout"]
VALUES = {"zero": "0", "negative": "-3", "huge": str(10 ** 30), "text": "ten", "nan": "nan"}
# Values that mean something, as in vLLM: greedy (0) temperature (above 2 vLLM refuses it, and
# so does this engine), no top-k limit (0, or more than the vocabulary), only the sampled
# token's logprob, any seed, a max-num-seqs above what the KV cache holds (the scheduler admits
# what fits). Every other int flag past 2**53 is refused by the parser.
ACCEPTED = {("--temperature", "zero"), ("--top-k", "zero"), ("--logprobs", "zero"),
            ("--seed", "zero"), ("--seed", "negative")}
CASES = [(flag, kind) for flag in NUMERIC for kind in VALUES]


@pytest.mark.parametrize("flag,kind", CASES, ids=[f"{f[2:]}-{k}" for f, k in CASES])
def test_a_numeric_flag_out_of_range_is_one_error_line(flag, kind, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out.jsonl"
    o = run_checks([flag, VALUES[kind], "--max-tokens" if flag != "--max-tokens" else "--seed", 4,
                    "--output", out], monkeypatch, capsys)
    if (flag, kind) in ACCEPTED:
        assert o.rc == 0 and o.started, o
    else:
        assert o.refused(flag) or o.refused(flag.removeprefix("--").replace("-", "_")), o
        assert not o.started and not list(tmp_path.iterdir())
