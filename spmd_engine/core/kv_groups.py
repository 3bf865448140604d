"""KV-cache groups for a model that mixes full and sliding-window layers (issue 53): which groups
there are and how many blocks each gets, for the scheduler, the workers and the plan alike.

A group is the set of layers sharing one window (the full-attention layers are one group). Each
group has its own block pool and its own block table per request, so a sliding group frees what
falls out of its window while the full group keeps every block (vLLM's hybrid KV-cache manager
does this over one shared pool of equal-sized pages; that needs groups of equal layer counts,
which Gemma 3's 5 : 1 has not without padding, so here each group's pool is its own).

Block counts: the budget buys `num_blocks` blocks for the full group (the count the executor,
the engine and the plan pass around, as before); a sliding group gets at most what its
sequences can hold at once, `max_num_seqs` windows plus a step's chunk, never more than the full
group (a sliding table is never longer than a full one). Running short only preempts (the
scheduler allocates every group or none), so the count bounds memory, not correctness. Every
rank derives the sliding count from the agreed `num_blocks` by the same rule, so their pools
agree.
"""

from __future__ import annotations

from typing import Mapping


def group_windows(windows: tuple[int | None, ...], model_config=None) -> tuple[int | None, ...]:
    """The groups' windows, full attention (None) first, or () when one table serves every layer:
    a single window (core/kv_cache_manager.py frees behind it) or routing replay (it reads a
    cached prefix's expert rows back by KV slot, which a freed block lost: model/windows.py)."""
    if model_config is not None and model_config.enable_return_routed_experts:
        return ()
    kinds = set(windows)
    if len(kinds) < 2:
        return ()
    return tuple(sorted(kinds, key=lambda w: -1 if w is None else w))


def bytes_by_window(model) -> dict[int | None, int]:
    """One token's K and V in a rank's layers of each group (`model`: its stage, its heads)."""
    out: dict[int | None, int] = {}
    for layer in model._attention_layers():
        per = 2 * layer.num_kv_heads * layer.head_dim * model.dtype.itemsize
        out[layer.sliding_window] = out.get(layer.sliding_window, 0) + per
    return out


def window_blocks(window: int, block_size: int, scheduler_config) -> int:
    """The most blocks a sliding group's sequences hold at once: per sequence the W - 1 keys
    before its chunk and a block cut part way each side, plus one step's chunks."""
    sc = scheduler_config
    per_seq = -(-(window - 1) // block_size) + 2
    return sc.max_num_seqs * per_seq + -(-sc.max_num_batched_tokens // block_size)


def blocks_per_group(num_blocks: int, windows: tuple[int | None, ...], block_size: int,
                     scheduler_config) -> dict[int | None, int]:
    """Each group's pool size, by window, for `num_blocks` full-group blocks."""
    return {w: num_blocks if w is None else min(num_blocks, window_blocks(w, block_size, scheduler_config))
            for w in windows}


def num_blocks_for(budget_bytes: int, block_size: int, bytes_by_window: Mapping[int | None, int],
                   scheduler_config) -> int:
    """The most full-group blocks whose groups together fit `budget_bytes` (`bytes_by_window`:
    one token's K and V in this rank's layers of each group): `bytes_held` grows with the count,
    so a bisection finds it."""
    lo, hi = 0, max(0, budget_bytes) // (block_size * max(1, bytes_by_window.get(None, 0) or 1))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if bytes_held(mid, block_size, bytes_by_window, scheduler_config) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def bytes_held(num_blocks: int, block_size: int, bytes_by_window: Mapping[int | None, int],
               scheduler_config) -> int:
    """The bytes a rank's groups take for `num_blocks` full-group blocks."""
    counts = blocks_per_group(num_blocks, tuple(bytes_by_window), block_size, scheduler_config)
    return sum(counts[w] * block_size * b for w, b in bytes_by_window.items())


def describe(num_blocks: int, block_size: int, bytes_by_window: Mapping[int | None, int], scheduler_config) -> str:
    counts = blocks_per_group(num_blocks, tuple(bytes_by_window), block_size, scheduler_config)
    parts = [f"{'full' if w is None else f'window {w}'}: {counts[w]} blocks" for w in bytes_by_window]
    total = bytes_held(num_blocks, block_size, bytes_by_window, scheduler_config)
    return (f"KV cache groups ({', '.join(parts)}) of {block_size} tokens = {num_blocks * block_size} tokens "
            f"of full context, {total / (1 << 30):.3f} GiB per rank")
