"""Figure structured: decode at B=8 with every request under a JSON schema against the same
requests unconstrained, one engine, in turns; and the first constrained request's latency
(its grammar compiled against the whole vocabulary) against the same request unconstrained."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from benchmarks.harness import LLAMA_SHAPE, emit, loadavg, prompts_for, random_llama

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["text", "n"]}


def llama_with_tokenizer(args) -> str:
    """The bench Llama's weights beside a byte-level BPE tokenizer.json of its whole 32k
    vocabulary (the 256 byte tokens, then letter strings of 2-6 bytes, EOS last): the
    grammar backend compiles against, and masks, a vocabulary of real size."""
    path = Path(args.workdir) / "llama_h512_l8_p8k_tok"
    if (path / "tokenizer.json").exists():
        return str(path)
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    base = Path(random_llama(args))
    path.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if not (path / f.name).exists():
            (path / f.name).symlink_to(f)
    vocab_size = LLAMA_SHAPE["vocab_size"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab, rng = {c: i for i, c in enumerate(sorted(alphabet))}, random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    while len(vocab) < vocab_size - 1:
        vocab.setdefault("".join(rng.choice(letters) for _ in range(rng.randint(2, 6))), len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.add_special_tokens(["</s>"])
    tok.save(str(path / "tokenizer.json"))
    config = json.loads((base / "config.json").read_text())
    config["eos_token_id"] = tok.token_to_id("</s>")
    (path / "config.json").unlink()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def fig_structured(args) -> None:
    from spmd_engine import LLM, SamplingParams
    from spmd_engine.engine.structured import backend
    model_dir = llama_with_tokenizer(args)
    batch, new = 8, 16 if args.quick else 64
    prompts = prompts_for(batch, 32, LLAMA_SHAPE["vocab_size"])
    kinds = {"free": {}, "json": {"structured_outputs": {"json": SCHEMA}}}

    def params(kind: str, max_tokens: int):
        return [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, **kinds[kind]) for i in range(batch)]

    with LLM(model=model_dir, dtype="bfloat16", max_num_seqs=batch, distributed_executor_backend="uni") as llm:
        llm.generate(prompts, params("free", 2))  # the engine's own first steps, out of both timings
        backend._BACKENDS.clear()  # the first constrained request builds the vocabulary's tables too
        first = {}
        for kind in ("free", "json"):
            t0 = time.perf_counter()
            llm.generate(prompts[:1], params(kind, 1)[:1])
            first[kind] = time.perf_counter() - t0
        emit("structured_first_request_s", first["json"], first["free"], first["json"] / first["free"], "s",
             ratio_is="value/baseline, lower is better",
             value_is="the first JSON-schema request (max_tokens=1): vocabulary tables + grammar compile + step",
             baseline_is="the same request unconstrained", vocab=LLAMA_SHAPE["vocab_size"], loadavg_1m=loadavg())
        rates = {kind: [] for kind in kinds}
        for _ in range(args.reps + 1):  # the first round warms both
            for kind in kinds:
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params(kind, new))
                rates[kind].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0))
        v, b = statistics.median(rates["json"][1:]), statistics.median(rates["free"][1:])
        emit("structured_json_decode_tokens_per_s_b8", v, b, v / b, "tokens/s",
             ratio_is="value/baseline, higher is better; target >= 0.8",
             value_is=f"LLM.generate, {batch} requests under a JSON schema, temperature 1, seeded",
             baseline_is="the same requests unconstrained, same engine, in turns", batch=batch, dtype="bfloat16",
             new_tokens=new, reps=args.reps, vocab=LLAMA_SHAPE["vocab_size"],
             rep_tokens_per_s={k: [round(x, 1) for x in r] for k, r in rates.items()}, loadavg_1m=loadavg())
