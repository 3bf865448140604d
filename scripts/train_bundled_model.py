#!/usr/bin/env python
"""Train the bundled default model: a byte-level Llama that recites the Zen of Python.

The bundled model has to make end-to-end runs checkable by eye and by test:
greedy decoding from the start of any line of the Zen (e.g. "Beautiful is")
must continue the text exactly and then emit EOS. So it is trained to
memorise that one text from every offset: each training row is BOS + the text
from a random start to its end + EOS, so a prompt beginning anywhere is
in-distribution at every position up to the longest context it will see.

Training stops only when, for every line-start prompt, the teacher-forced
argmax reproduces the rest of the text (which is what greedy decoding does)
with a logit margin of at least MIN_MARGIN over the runner-up at every
generated position: reduction-order differences under TP/PP (~1e-5) can then
never flip a token. Finally the saved checkpoint is reloaded with
spmd_engine's loader and decoded greedily through the KV-cache path, all line
prompts in one mixed batch; any mismatch fails the script.

    python scripts/train_bundled_model.py [--out spmd_engine/bundled]
Deterministic (fixed seed, 2 threads); a few minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import io
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from spmd_engine.model import AttentionMetadata, ByteTokenizer, CausalLM, load_model  # noqa: E402
from spmd_engine.model.solo import SoloGroup  # noqa: E402

SEED = 0
MIN_MARGIN = 4.0
LR, MIN_LR, WARMUP, DECAY_STEPS = 3e-3, 1e-4, 30, 1000
SHORT_ROWS, SHORT_WINDOW = 16, 128
LONG_ROWS, LONG_EVERY = 2, 4
EVAL_EVERY = 50
BOS, EOS = ByteTokenizer.bos_token_id, ByteTokenizer.eos_token_id
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": ByteTokenizer.vocab_size,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": ByteTokenizer.bos_token_id,
    "eos_token_id": ByteTokenizer.eos_token_id,
    "spmd_engine_tokenizer": "bytes",
}


def zen_text() -> str:
    """The Zen of Python, computed from the `this` module (which prints it on import)."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13")


def line_prompts(text: str) -> list[str]:
    """For each non-empty line: its first words, as few as make the prompt unique in the text
    (at least two), so the continuation is determined ("Although" alone is not)."""
    prompts = []
    for line in text.split("\n"):
        if line:
            words = line.split(" ")
            n = min(2, len(words))
            while text.count(" ".join(words[:n])) > 1 and n < len(words):
                n += 1
            prompts.append(" ".join(words[:n]))
    return prompts


def continuation_rows(text: str, prompts: list[str], tok: ByteTokenizer) -> list[tuple[list[int], int]]:
    """(BOS + text from the prompt's line to the end + EOS, prompt length in tokens)."""
    rows = []
    for prompt in prompts:
        start = text.index(prompt)
        rows.append((tok.encode(text[start:]) + [tok.eos_token_id], len(tok.encode(prompt))))
    return rows


def init_weights(model: CausalLM, gen: torch.Generator) -> None:
    for name, p in model.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
        p.requires_grad_(True)


def padded_batch(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T] and a loss mask over next-token targets [B, T-1]."""
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T - 1, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r) - 1] = True
    return ids, mask


def logits_of(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    hidden = model(ids, positions, None)["hidden_states"]
    return model.compute_logits(hidden.reshape(-1, hidden.shape[-1])).view(*ids.shape, -1)


@torch.no_grad()
def min_margin(model: CausalLM, rows: list[tuple[list[int], int]]) -> tuple[float, int, tuple[int, int]]:
    """Smallest (correct logit - best other logit) over every generated position of every
    row, how many positions greedy decoding would get wrong, and (row, position) of the worst."""
    ids, _ = padded_batch([r for r, _ in rows])
    logits = logits_of(model, ids)
    worst, wrong, where = float("inf"), 0, None
    for i, (row, prompt_len) in enumerate(rows):
        targets = torch.tensor(row[prompt_len:])
        lg = logits[i, prompt_len - 1 : len(row) - 1]
        correct = lg.gather(1, targets[:, None]).squeeze(1)
        other = lg.scatter(1, targets[:, None], float("-inf")).max(dim=1).values
        margins = correct - other
        if margins.min().item() < worst:
            worst, where = margins.min().item(), (i, prompt_len + int(margins.argmin()))
        wrong += int((margins <= 0).sum())
    return worst, wrong, where


def sample_rows(data: list[int], gen: torch.Generator, count: int, window: int | None) -> list[list[int]]:
    """BOS + text from a random start, then either `window` bytes or (window None)
    everything to the end followed by EOS. Half the starts are uniform over the
    text (mid-word included), half are line starts, where prompts begin and
    where the first bytes after BOS must already be decisive."""
    line_starts = [0] + [i + 1 for i, b in enumerate(data) if b == ord("\n") and i + 1 < len(data)]
    rows = []
    for _ in range(count):
        if torch.rand((), generator=gen) < 0.5:
            s = int(torch.randint(0, len(data), (), generator=gen))
        else:
            s = line_starts[int(torch.randint(0, len(line_starts), (), generator=gen))]
        end = len(data) if window is None else s + window
        rows.append([BOS] + data[s:end] + ([EOS] if end >= len(data) else []))
    return rows


def loss_of(model: CausalLM, rows: list[list[int]]) -> torch.Tensor:
    ids, mask = padded_batch(rows)
    logits = logits_of(model, ids[:, :-1])
    return F.cross_entropy(logits[mask], ids[:, 1:][mask])


def lr_factor(step: int) -> float:
    """Linear warm-up, cosine decay to MIN_LR over DECAY_STEPS, then MIN_LR:
    memorising to large margins needs the small steps at the end (a constant
    rate keeps flipping tokens), and the tail at MIN_LR leaves room for a
    machine whose float rounding takes a slightly different path."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    progress = min(1.0, (step - WARMUP) / (DECAY_STEPS - WARMUP))
    return (MIN_LR + (LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * progress))) / LR


def train(text: str, max_steps: int, log) -> CausalLM:
    """Mostly short windows (cheap: attention cost grows with length squared),
    and every LONG_EVERY steps a few rows running to the end of the text, so
    attention also learns to ignore context as far back as inference reaches."""
    data = list(text.encode("utf-8"))
    gen = torch.Generator().manual_seed(SEED)
    solo = SoloGroup()
    model = CausalLM(CONFIG, solo, solo)
    init_weights(model, gen)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    eval_rows = continuation_rows(text, line_prompts(text), ByteTokenizer())
    for step in range(1, max_steps + 1):
        loss = loss_of(model, sample_rows(data, gen, SHORT_ROWS, SHORT_WINDOW))
        if step % LONG_EVERY == 0:
            loss = loss + loss_of(model, sample_rows(data, gen, LONG_ROWS, None))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % EVAL_EVERY == 0:
            margin, wrong, (row, pos) = min_margin(model, eval_rows)
            context = bytes(t for t in eval_rows[row][0][max(1, pos - 12) : pos] if t < 256).decode()
            log(f"step {step}: loss {loss.item():.4f}, wrong tokens {wrong}, "
                f"min margin {margin:.2f} (after {context!r}, position {pos})")
            if wrong == 0 and margin >= MIN_MARGIN:
                return model
    raise SystemExit(f"training did not reach margin {MIN_MARGIN} in {max_steps} steps")


def hf_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """Our TP=1 parameters under HF names (fused qkv / gate_up split back apart)."""
    out = {}
    for name, p in model.named_parameters():
        p = p.detach().contiguous()
        if ".qkv_proj." in name:
            qkv = model.get_submodule(name.rsplit(".", 1)[0])
            sizes = [qkv.q_size, qkv.kv_size, qkv.kv_size]
            for part, t in zip(("q_proj", "k_proj", "v_proj"), p.split(sizes, dim=0)):
                out[name.replace("qkv_proj", part)] = t.contiguous()
        elif ".gate_up_proj." in name:
            gate, up = p.chunk(2, dim=0)
            out[name.replace("gate_up_proj", "gate_proj")] = gate.contiguous()
            out[name.replace("gate_up_proj", "up_proj")] = up.contiguous()
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = p[: CONFIG["vocab_size"]].contiguous()  # drop the TP vocab padding rows
        else:
            out[name] = p
    return out


def save(model: CausalLM, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(hf_state_dict(model), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "model.safetensors").chmod(0o644)  # safetensors writes 0600; the package ships it
    (out_dir / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")


@torch.no_grad()
def greedy_decode(model: CausalLM, prompts: list[list[int]], max_new: int, eos: int) -> list[list[int]]:
    """Batched greedy decoding through the paged KV cache: one packed prefill of all
    prompts, then one token per row per step, finished rows dropped from the batch."""
    block_size = 16
    per_seq = -(-(max(len(p) for p in prompts) + max_new + 1) // block_size)
    model.allocate_kv_cache(per_seq * len(prompts), block_size)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    outputs: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    ctx = [0] * len(prompts)
    feed = [list(p) for p in prompts]
    for _ in range(max_new):
        attn = AttentionMetadata.build(ctx, [len(f) for f in feed], [tables[r] for r in live], block_size, "cpu")
        hidden = model(torch.tensor(attn.pack(feed)), attn.positions, attn)["hidden_states"]
        last = torch.tensor([attn.row_start[i] + len(f) - 1 for i, f in enumerate(feed)])
        next_ids = model.compute_logits(hidden[last]).argmax(dim=-1).tolist()
        keep = []
        for i, (row, token) in enumerate(zip(live, next_ids)):
            outputs[row].append(token)
            if token != eos:
                keep.append(i)
        if not keep:
            break
        ctx = [ctx[i] + len(feed[i]) for i in keep]
        live = [live[i] for i in keep]
        feed = [[next_ids[i]] for i in keep]
    return outputs


def verify(out_dir: Path, text: str, log) -> None:
    """Reload from disk with spmd_engine's loader and decode every line prompt."""
    tok = ByteTokenizer()
    solo = SoloGroup()
    model = load_model(out_dir, solo, solo)
    prompts = line_prompts(text)
    outputs = greedy_decode(model, [tok.encode(p) for p in prompts], len(text) + 2, tok.eos_token_id)
    failures = 0
    for prompt, out in zip(prompts, outputs):
        expected = text[text.index(prompt) + len(prompt):]
        ok = out[-1:] == [tok.eos_token_id] and tok.decode(out) == expected
        failures += not ok
        if not ok:
            log(f"MISMATCH from {prompt!r}: {tok.decode(out)[:80]!r}")
    if failures:
        raise SystemExit(f"{failures} of {len(prompts)} prompts did not reproduce the text")
    log(f"verified: greedy decoding from all {len(prompts)} line prompts reproduces the text and ends with EOS")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train the bundled Zen-of-Python model.")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "spmd_engine" / "bundled"))
    parser.add_argument("--max-steps", type=int, default=1600)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    torch.manual_seed(SEED)
    t0 = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    text = zen_text()
    model = train(text, args.max_steps, log)
    save(model, Path(args.out))
    log(f"saved to {args.out}")
    verify(Path(args.out), text, log)


if __name__ == "__main__":
    main()
