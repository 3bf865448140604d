"""The experts of one MoE block, fused into two 3-D weights, in either of vLLM's shardings.

Weights: `w13_weight` [experts_here, 2 * width_here, hidden] (each expert's
gate rows, then its up rows) and `w2_weight` [experts_here, hidden, width_here].

Sharding over `group` (the ranks that share this block's experts):
- tensor-parallel (default): every rank holds every expert, each expert's
  gate/up rows column-split and its down columns row-split, like a dense
  SwiGLU MLP; each rank's partial sums are all-reduced.
- expert-parallel (`expert_parallel=True`, `--enable-expert-parallel`): whole
  experts, a contiguous block of num_experts / group size per rank (rank r
  holds experts [r * n, (r + 1) * n), as vLLM places them); each rank computes
  only its experts' share and the shares are summed over the group.

Token exchange (the collective choice): **all-gather dispatch, all-reduce
combine.** When the group spans ranks that hold different tokens (DP
replicas: the EP group is DP x PCP x TP), each rank all-gathers every
replica's tokens and their routing (expert ids and weights, computed locally
by the replicated router) over `dispatch_group` (the DP group), padded to the
largest replica's token count; every rank then computes its experts on all of
them, the partial outputs are all-reduced over `group` and each rank keeps its
own rows (an all-reduce then slice, which equals a reduce-scatter; gloo has
no reduce-scatter). Within one replica (DP = 1, or no EP) tokens are already
the same on every rank, so there is no dispatch and the combine is the plain
all-reduce. All-to-all would move fewer bytes at large scale; all-gather keeps
the step's collectives fixed in number and shape-independent of routing,
which is what an idle replica's dummy forward must match.

Options (gpt-oss): `bias` adds each expert's gate/up and down biases (the down bias once:
on the rank holding width slice 0, so the combine's sum counts it once), `swiglu_limit` /
`swiglu_alpha` the clamped SwiGLU; both load from HF's all-experts tensors (`gate_up_proj`
[E, H, 2I] with gate and up interleaved column by column, `down_proj` [E, I, H], their biases),
a rank reading only its experts' and widths' slices.

Computation is batched per expert: the (token, expert) pairs are sorted by
expert, and each expert runs two matmuls over all its tokens at once; the
results are weighted and added back per token in expert order (HF's order).
On CPU each expert's two matrices are also kept packed for oneDNN
(packed_weights.py: faster matmuls at decode sizes, bitwise equal in bf16); the packs cost a second copy of the expert weights and are rebuilt
after any write through `weight_loader`.

In batch-invariant mode (`batch_invariant`) each (token, expert) pair's down projection is
batch_invariant's chunked tree, its partial sums combined over the group by an all-gather and
the same tree (an EP rank's pairs of other ranks' experts are exact zeros), and a token's k
weighted outputs are added in routing order: no result depends on the other tokens, on how
they group by expert, or on TP / EP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spmd_engine.kernels.packed_weights import linear
from spmd_engine.model.layers import batch_invariant as bi
from spmd_engine.model.shard import Loaded, check_shape, copy_into, divide, read_range

# shard_id parts: HF's gate (w1), up (w3) and down (w2) projections of one expert
EXPERT_PARTS = ("w1", "w3", "w2")
# shard_id parts of the all-experts tensors (gpt-oss's names): (part, None)
FUSED_PARTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def _apply(fn, x):
    return fn(x)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor, pointwise=_apply) -> torch.Tensor:
    return pointwise(F.silu, gate) * up


class ClampedSwiGLU:
    """gpt-oss's activation: gate clamped above at `limit`, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate), in transformers' order of operations."""

    def __init__(self, limit: float, alpha: float):
        self.limit, self.alpha = limit, alpha

    def __call__(self, gate: torch.Tensor, up: torch.Tensor, pointwise=_apply) -> torch.Tensor:
        gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * pointwise(torch.sigmoid, gate * self.alpha))


class FusedMoE(nn.Module):
    batch_invariant = False

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, group,
                 expert_parallel: bool = False, dispatch_group=None, dtype: torch.dtype | None = None,
                 bias: bool = False, swiglu_limit: float | None = None, swiglu_alpha: float = 1.0):
        super().__init__()
        self.activation = silu_and_mul if swiglu_limit is None else ClampedSwiGLU(swiglu_limit, swiglu_alpha)
        self.group = group
        self.dispatch_group = dispatch_group if dispatch_group is not None and dispatch_group.world_size > 1 \
            else None
        self.expert_parallel = expert_parallel
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        size, rank = group.world_size, group.rank_in_group
        if expert_parallel:
            self.num_local_experts = divide(num_experts, size, "num_experts (expert parallel size)")
            self.first_expert = rank * self.num_local_experts
            self.width = intermediate_size
            self.width_start = 0
        else:
            self.num_local_experts, self.first_expert = num_experts, 0
            self.width = divide(intermediate_size, size, "expert intermediate size")
            self.width_start = rank * self.width
        n, w = self.num_local_experts, self.width
        self.w13_weight = nn.Parameter(torch.empty(n, 2 * w, hidden_size, dtype=dtype), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(n, hidden_size, w, dtype=dtype), requires_grad=False)
        self.w13_bias = self.w2_bias = None
        if bias:
            self.w13_bias = nn.Parameter(torch.empty(n, 2 * w, dtype=dtype), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(n, hidden_size, dtype=dtype), requires_grad=False)
        self.packed_batch_hint: int | None = None  # set by pack_experts
        self._packs: tuple | None = None

    def pack_experts(self, batch_hint: int) -> None:
        """Use oneDNN-packed copies of every expert's matrices from now on (built lazily)."""
        self.packed_batch_hint, self._packs = batch_hint, None

    def drop_packed(self) -> None:
        self._packs = None

    def _matrices(self):
        """(w13, w2) per expert: the packed copies when packing is on, else the parameters."""
        if self.packed_batch_hint is None or self.w13_weight.numel() == 0:
            return self.w13_weight, self.w2_weight
        key = (self.w13_weight.data_ptr(), self.w2_weight.data_ptr())
        if self._packs is None or self._packs[0] != key:
            reorder = torch.ops.mkldnn._reorder_linear_weight
            self._packs = (key, [reorder(w, self.packed_batch_hint) for w in self.w13_weight],
                           [reorder(w, self.packed_batch_hint) for w in self.w2_weight])
        return self._packs[1], self._packs[2]

    def extra_repr(self) -> str:
        mode = "ep" if self.expert_parallel else "tp"
        return (f"experts={self.local_experts.start}..{self.local_experts.stop - 1} of {self.num_experts}, "
                f"width_per_rank={self.width}, {mode}={self.group.world_size}")

    @property
    def local_experts(self) -> range:
        return range(self.first_expert, self.first_expert + self.num_local_experts)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: tuple[str, int]) -> None:
        """One HF expert matrix (`shard_id` = (part, expert)) into this rank's slot for it."""
        part, expert = shard_id
        if part in FUSED_PARTS:
            return self._load_fused(param, loaded, part)
        if part not in EXPERT_PARTS or expert not in self.local_experts:
            raise ValueError(f"FusedMoE holds experts {self.local_experts}, parts {EXPERT_PARTS}; "
                             f"got {part} of expert {expert}")
        self._packs = None  # the packed copies no longer match
        e, w, start = expert - self.first_expert, self.width, self.width_start
        if part == "w2":
            check_shape(loaded, (self.hidden_size, self.intermediate_size), f"expert {expert} down")
            copy_into(param.data[e], read_range(loaded, 1, start, start + w))
            return
        check_shape(loaded, (self.intermediate_size, self.hidden_size), f"expert {expert} {part}")
        offset = 0 if part == "w1" else w
        copy_into(param.data[e, offset:offset + w], read_range(loaded, 0, start, start + w))

    def _load_fused(self, param: nn.Parameter, loaded: Loaded, part: str) -> None:
        """This rank's experts (and width slice) of an all-experts HF tensor."""
        self._packs = None
        E, H, I = self.num_experts, self.hidden_size, self.intermediate_size
        experts, w, start = slice(self.first_expert, self.first_expert + self.num_local_experts), self.width, \
            self.width_start
        both = slice(2 * start, 2 * (start + w))  # interleaved gate/up columns of widths [start, start + w)
        if part == "gate_up_proj":
            check_shape(loaded, (E, H, 2 * I), "experts gate_up_proj")
            block = loaded[experts, :, both]  # [n, H, 2w]
            copy_into(param.data, torch.cat([block[..., 0::2], block[..., 1::2]], dim=-1).transpose(1, 2))
        elif part == "gate_up_proj_bias":
            check_shape(loaded, (E, 2 * I), "experts gate_up_proj_bias")
            block = loaded[experts, both]
            copy_into(param.data, torch.cat([block[:, 0::2], block[:, 1::2]], dim=-1))
        elif part == "down_proj":
            check_shape(loaded, (E, I, H), "experts down_proj")
            copy_into(param.data, loaded[experts, start:start + w, :].transpose(1, 2))
        else:
            check_shape(loaded, (E, H), "experts down_proj_bias")
            copy_into(param.data, loaded[experts, :])

    def _down_bias(self) -> torch.Tensor | None:
        """The down bias where this rank adds it: once per combine (width slice 0's rank)."""
        return self.w2_bias if self.width_start == 0 else None

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H] this rank's tokens, `weights`/`ids` [T, k] their routing -> [T, H] (all experts)."""
        combine = self.invariant_combine if self.batch_invariant else self.reduce
        if self.dispatch_group is None:
            return combine(x, weights, ids)
        x_all, weights_all, ids_all, row = dispatch(self.dispatch_group, x, weights, ids)
        y = combine(x_all, weights_all, ids_all)
        return y[row:row + x.shape[0]]

    def reduce(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.compute(x, weights, ids))

    def invariant_combine(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        width_split = 1 if self.expert_parallel else self.group.world_size
        pairs = invariant_pair_outputs(x, ids, self.w13_weight, self.w2_weight, self.first_expert, width_split,
                                       self.w13_bias, self._down_bias(), self.activation)
        y = bi.gather_tree(pairs, self.group).view(*ids.shape, -1)  # [T, k, H]
        out = torch.zeros_like(x)
        for j in range(ids.shape[1]):
            out = out + (y[:, j] * weights[:, j:j + 1]).to(x.dtype)
        return out

    def compute(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's share: its experts (or its width slice of all) over the tokens routed to them."""
        w13, w2 = self._matrices()
        return expert_outputs(x, weights, ids, w13, w2, self.first_expert, self.w13_bias, self._down_bias(),
                              self.activation)


def expert_outputs(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13, w2,
                   first_expert: int = 0, b13=None, b2=None, activation=silu_and_mul) -> torch.Tensor:
    """sum over each token's experts held in (w13, w2) of weight * down(silu(gate(x)) * up(x))
    (or `activation(gate, up)`; `b13`, `b2` [experts, ...] the biases, None: none).

    `w13`/`w2`: [experts, ...] tensors or per-expert lists (of packed matrices).
    Experts outside [first_expert, first_expert + len(w13)) (and ids < 0, padding)
    contribute nothing here: another rank holds them.
    """
    tokens, k = ids.shape
    local = ids.reshape(-1) - first_expert
    held = ((local >= 0) & (local < len(w13))).nonzero().squeeze(1)
    local = local[held]
    order = torch.argsort(local, stable=True)  # pairs grouped by expert, token order within
    pairs = held[order]
    counts = torch.bincount(local, minlength=len(w13)).tolist()
    token_of = torch.div(pairs, k, rounding_mode="floor")
    xs = x[token_of]
    out = torch.empty_like(xs)
    start = 0
    for expert, count in enumerate(counts):  # one pair of matmuls per expert, over all its tokens
        if count:
            rows = slice(start, start + count)
            gate, up = linear(xs[rows], w13[expert], None if b13 is None else b13[expert]).chunk(2, dim=-1)
            out[rows] = linear(activation(gate, up), w2[expert], None if b2 is None else b2[expert])
            start += count
    scaled = (out * weights.reshape(-1)[pairs].unsqueeze(1)).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, scaled)


def invariant_pair_outputs(x: torch.Tensor, ids: torch.Tensor, w13, w2, first_expert: int,
                           width_split: int, b13=None, b2=None, activation=silu_and_mul) -> torch.Tensor:
    """[T * k, H]: pair (t, j)'s expert output if this rank holds expert ids[t, j] (its subtree of
    the down projection when the width is split over `width_split` ranks), else zeros."""
    tokens, k = ids.shape
    local = ids.reshape(-1) - first_expert
    held = ((local >= 0) & (local < len(w13))).nonzero().squeeze(1)
    order = torch.argsort(local[held], stable=True)
    pairs = held[order]
    counts = torch.bincount(local[held], minlength=len(w13)).tolist()
    xs = x[torch.div(pairs, k, rounding_mode="floor")]
    out = x.new_zeros(tokens * k, x.shape[-1])
    start = 0
    for expert, count in enumerate(counts):
        if count:
            rows = slice(start, start + count)
            gate, up = bi.linear(xs[rows], w13[expert], None if b13 is None else b13[expert]).chunk(2, dim=-1)
            down = bi.partial_tree(activation(gate, up, bi.pointwise), w2[expert], width_split)
            out[pairs[rows]] = down if b2 is None else down + b2[expert]
            start += count
    return out


def dispatch(group, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
    """All-gather every rank's tokens and routing over `group`, each padded to the largest count.

    Returns (x_all, weights_all, ids_all, first row of this rank's tokens). Padding
    rows carry expert id -1, so no rank computes anything for them. Ids travel as
    float32 next to the weights (exact below 2**24) to make one gather of routing.
    """
    n, k = ids.shape
    sizes = group.all_gather(torch.tensor([n], dtype=torch.int64, device=x.device), dim=0).tolist()
    most = max(sizes)
    routing = torch.cat([ids.to(torch.float32), weights.to(torch.float32)], dim=1)
    if most > n:
        x = F.pad(x, (0, 0, 0, most - n))
        routing = torch.cat([routing, routing.new_full((most - n, 2 * k), -1.0)])
    x_all = group.all_gather(x.contiguous(), dim=0)
    routing_all = group.all_gather(routing, dim=0)
    ids_all = routing_all[:, :k].to(torch.int64)
    weights_all = routing_all[:, k:].to(weights.dtype)
    return x_all, weights_all, ids_all, group.rank_in_group * most
