"""Shared fixtures for engine tests: a tiny random checkpoint and a no-cache reference decode."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from make_random_checkpoint import make_random_checkpoint  # noqa: E402

TINY = dict(hidden_size=64, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=128,
            vocab_size=300, max_position_embeddings=256)


def make_tiny_checkpoint(path: Path, **overrides) -> Path:
    return make_random_checkpoint(path, **{**TINY, **overrides})


@torch.inference_mode()
def reference_greedy(model_dir: Path, prompt: list[int], max_tokens: int, eos: int | None = None) -> list[int]:
    """Greedy decoding that recomputes the whole sequence every step: no KV cache, no
    scheduler, no batching, one process. What the engine must reproduce."""
    from spmd_engine.model import load_model
    from spmd_engine.model.solo import SoloGroup
    model = load_model(model_dir, SoloGroup(), SoloGroup())
    ids = list(prompt)
    out = []
    for _ in range(max_tokens):
        x = torch.tensor([ids])
        positions = torch.arange(len(ids))[None, :]
        hidden = model.forward(x, positions, None, None)["hidden_states"]
        token = int(model.compute_logits(hidden[0, -1:]).argmax(-1))
        out.append(token)
        ids.append(token)
        if token == eos:
            break
    return out


def packed_step(rows, block_size: int = 4, blocks_per_seq: int = 4, device="cpu"):
    """A step of packed tokens over a paged cache where sequence k owns blocks
    k*blocks_per_seq ... (k+1)*blocks_per_seq - 1: rows are (k, tokens, context_len).
    Returns (ids [N] in the metadata's packed order, positions [N], metadata); bring
    per-token outputs back to row order with `md.to_row_order`."""
    from spmd_engine.model.layers.attention import AttentionMetadata
    tables = [list(range(k * blocks_per_seq, (k + 1) * blocks_per_seq)) for k, _, _ in rows]
    md = AttentionMetadata.build([c for _, _, c in rows], [len(t) for _, t, _ in rows], tables, block_size, device)
    ids = torch.tensor(md.pack([list(tokens) for _, tokens, _ in rows]), dtype=torch.long)
    return ids, md.positions, md
