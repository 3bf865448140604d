"""Vectorised random draws: temperature, min_p, top_k, top_p, then one uniform per row.

Why inverse-CDF with one counter-based uniform per row (rather than Gumbel /
exponential noise over the vocabulary, or a torch.Generator per request):
- The uniform is splitmix64(seed, output position), computed for all rows at
  once on the host (B numbers, nothing else): a request's draw depends only on
  its seed, how many tokens it has sampled and its own logits, never on which
  rows share the batch, which replica runs it or how many ranks compute it, and
  every rank computes the same bits. Noise over the vocabulary would cost
  B x V random numbers a step, as much work as the logits themselves.
- The kept tokens are ordered by vocabulary id for the cumulative sum, so ties
  between equal logits (common in bf16) cannot change the outcome, and every
  filter is a value threshold (top_k keeps ties of the k-th value, as vLLM).

Rows with a top_k (the usual RL setting) never touch the full vocabulary
beyond one max-per-chunk pass: the k-th largest value is found among the
tokens of the top chunks (`_top_candidates`), which is exact whenever that
value lies strictly above the smallest gathered chunk maximum (checked per
row; the rare row that fails takes the full path, with the same result).
Rows without a top_k use the full path: cumulative sums over the vocabulary,
plus one sort when they set top_p (as vLLM).
"""

from __future__ import annotations

import numpy as np
import torch

CHUNK = 64  # tokens per chunk of the max-per-chunk pass
_M64 = (1 << 64) - 1


def uniforms(seeds: list[int], positions: list[int]) -> torch.Tensor:
    """One float64 in [0, 1) per row from (seed, position): two splitmix64 rounds."""
    s = np.array([x & _M64 for x in seeds], dtype=np.uint64)
    p = np.array(positions, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = _mix(_mix(s ^ np.uint64(0x5851F42D4C957F2D)) + (p + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15))
    return torch.from_numpy((h >> np.uint64(11)).astype(np.float64) * 2.0 ** -53)


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def draw(x: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float],
         min_p: list[float], u: torch.Tensor, bounded: bool = True) -> torch.Tensor:
    """Sampled ids [R] for float32 logits [R, V] (top_k 0 = off). `bounded=False` forces the
    full-vocabulary path (the reference the bounded path must equal)."""
    rows, vocab = x.shape
    device = x.device
    out = torch.empty(rows, dtype=torch.long, device=device)
    limit = vocab // CHUNK // 4
    fast = [i for i, k in enumerate(top_k) if bounded and 0 < k and k + 8 <= limit]
    fast_set = set(fast)
    slow = [i for i in range(rows) if i not in fast_set]
    if fast:
        vals, ids, kth, exact = _top_candidates(select_rows(x, fast), [top_k[i] for i in fast])
        p = _params(fast, temperature, top_p, min_p, device)
        out[_index(fast, device)] = _choose(vals, ids, kth, *p, u[fast].to(device))
        # A row whose k-th value ties the gathered floor is redone on the full path.
        slow = sorted(slow + [i for i, good in zip(fast, exact.tolist()) if not good])
    if slow:
        sel = select_rows(x, slow)
        ks = [top_k[i] for i in slow]
        kth = _kth_full(sel, ks)
        ids = None  # the whole vocabulary, in order
        p = _params(slow, temperature, top_p, min_p, device)
        out[_index(slow, device)] = _choose(sel, ids, kth, *p, u[slow].to(device), ordered=True)
    return out


def select_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The given rows (x itself when that is all of them: no copy)."""
    return x if rows == list(range(x.shape[0])) else x.index_select(0, _index(rows, x.device))


def _index(rows: list[int], device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long).to(device)


def _params(rows, temperature, top_p, min_p, device):
    t = torch.tensor([float(temperature[i]) for i in rows], dtype=torch.float32).to(device)
    tp = torch.tensor([float(top_p[i]) for i in rows], dtype=torch.float64).to(device)
    mp = [float(min_p[i]) for i in rows]
    return t, tp, (torch.tensor(mp, dtype=torch.float32).to(device) if any(mp) else None)


def _top_candidates(x: torch.Tensor, ks: list[int]):
    """For each row, a superset of its k largest logits with their ids (sorted by value),
    its k-th largest value, and whether the superset provably holds every tie of it."""
    rows, vocab = x.shape
    device = x.device
    kmax = max(ks)
    n = vocab // CHUNK
    chunks = x[:, : n * CHUNK].unflatten(1, (n, CHUNK))
    g = min(n, kmax + 8)
    cval, cidx = chunks.amax(dim=2).topk(g, dim=1)
    floor = cval[:, -1]
    if x.is_contiguous():  # a plain copy of g whole chunks per row, through a sliding window
        window = x.as_strided((rows * vocab - CHUNK + 1, CHUNK), (1, 1), x.storage_offset())
        starts = (torch.arange(rows, device=device).unsqueeze(1) * vocab + cidx * CHUNK).flatten()
        vals = window.index_select(0, starts).view(rows, g * CHUNK)
    else:
        vals = chunks[torch.arange(rows, device=device).unsqueeze(1), cidx].flatten(1)  # [R, g * CHUNK]
    if vocab > n * CHUNK:  # the last partial chunk is always a candidate
        vals = torch.cat([vals, x[:, n * CHUNK:]], dim=1)
    kc = min(vals.shape[1], kmax + 16)
    top, pos = vals.topk(kc, dim=1)
    chunk = torch.div(pos, CHUNK, rounding_mode="floor")
    in_gathered = chunk < g
    ids = torch.where(in_gathered, cidx.gather(1, chunk.clamp_max(g - 1)) * CHUNK + pos % CHUNK,
                      n * CHUNK + pos - g * CHUNK)
    k = torch.tensor(ks, dtype=torch.long).to(device)
    kth = top.gather(1, (k - 1).unsqueeze(1)).squeeze(1)
    exact = kth > floor if g < n else torch.ones(rows, dtype=torch.bool, device=device)
    if kc < vals.shape[1]:
        exact &= top[:, -1] < kth
    return top, ids, kth, exact


def _kth_full(x: torch.Tensor, ks: list[int]) -> torch.Tensor | None:
    """Each row's k-th largest logit over the whole vocabulary (-inf where top_k is off)."""
    on = [k for k in ks if k > 0]
    if not on:
        return None
    kmax = min(max(on), x.shape[1])
    top = x.topk(kmax, dim=1).values
    k = torch.tensor([min(k, kmax) if k > 0 else 1 for k in ks], dtype=torch.long).to(x.device)
    kth = top.gather(1, (k - 1).unsqueeze(1)).squeeze(1)
    off = torch.tensor([k <= 0 for k in ks]).to(x.device)
    return kth.masked_fill(off, float("-inf"))


def _choose(vals, ids, kth, temperature, top_p, min_p, u, ordered: bool = False) -> torch.Tensor:
    """Inverse-CDF draw over the candidates kept by top_k (>= kth), min_p and top_p, in
    vocabulary-id order (`ordered`: vals is the whole vocabulary already)."""
    if not ordered:
        ids, order = ids.sort(dim=1)
        vals = vals.gather(1, order)
    cum = _kept_weights(vals, kth, temperature, top_p, min_p).cumsum_(dim=1)
    total = cum[:, -1:].contiguous()
    pick = torch.searchsorted(cum, (u.unsqueeze(1) * total.double()).to(cum.dtype), right=True)
    # u * total may round up to total: stay on the last kept token (where cum reaches total).
    pick = torch.minimum(pick, torch.searchsorted(cum, total))
    return pick.squeeze(1) if ordered else ids.gather(1, pick).squeeze(1)


def _kept_weights(vals, kth, temperature, top_p, min_p) -> torch.Tensor:
    """Weights p / p_max = exp((l - l_max) / T) of the tokens top_k (>= kth), min_p and top_p
    keep, 0 elsewhere (vals in vocabulary-id order). Full-size temporaries are updated in place."""
    weight = vals - vals.amax(dim=1, keepdim=True)
    weight.div_(temperature.unsqueeze(1)).exp_()
    if kth is not None:
        weight.masked_fill_(vals < kth.unsqueeze(1), 0.0)
    if min_p is not None:
        weight.masked_fill_(weight < min_p.unsqueeze(1), 0.0)
    if bool((top_p < 1).any()):
        # The nucleus: the most likely tokens whose mass first reaches top_p; every token as
        # likely as the last one in it stays too (ties cannot split on their order).
        mass = weight.cumsum(dim=1)[:, -1:]
        desc = weight.sort(dim=1, descending=True).values
        before = desc.cumsum(dim=1).sub_(desc)
        inside = (before < (top_p.unsqueeze(1) * mass.double()).float()).sum(dim=1, keepdim=True)
        del before
        weight.masked_fill_(weight < desc.gather(1, inside - 1), 0.0)
    return weight


def support(x: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float],
            min_p: list[float]) -> torch.Tensor:
    """[R, V] bool: the ids each row's draw could return (the kept weights above zero), computed
    over the whole vocabulary with the draw's own arithmetic, so it is exactly the set `draw`
    samples from on either path."""
    rows = list(range(x.shape[0]))
    t, tp, mp = _params(rows, temperature, top_p, min_p, x.device)
    return _kept_weights(x, _kth_full(x, list(top_k)), t, tp, mp) > 0
