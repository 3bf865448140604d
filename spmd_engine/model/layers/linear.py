"""Tensor-parallel linear layers (Megatron style), one class per way of cutting.

Each layer takes its TP group explicitly, allocates only its own shard, and
owns the `weight_loader` that knows which rows or columns of a checkpoint
tensor that shard is. Parameters do not require grad by default: the KV cache
is written in place, and an autograd graph there would chain every step.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from spmd_engine.kernels.packed_weights import linear
from spmd_engine.model.layers import batch_invariant as bi
from spmd_engine.model.shard import (
    Loaded,
    check_shape,
    copy_into,
    divide,
    read_all,
    read_range,
)

# The shard_id of a checkpoint tensor holding all of a fused layer's parts at once.
FUSED = "fused"


def _param(*shape: int, dtype: torch.dtype | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split over the group.

    Each rank computes its slice of the output features; no communication
    unless `gather_output`, because the usual consumer (attention heads, the
    SwiGLU product, a RowParallelLinear) works on the slice directly.
    """

    packable_weight = True  # see packed_weights.py
    batch_invariant = False  # CausalLM(batch_invariant=True) sets it: batch_invariant.py's kernels
    lora = None  # a LinearLoRA when the engine serves adapters (model/lora/)

    def __init__(
        self,
        input_size: int,
        output_size: int,
        group,
        bias: bool = False,
        gather_output: bool = False,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.group = group
        self.tp_size = group.world_size
        self.tp_rank = group.rank_in_group
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_rank = divide(output_size, self.tp_size, "output size")
        self.gather_output = gather_output
        self.weight = _param(self.output_size_per_rank, input_size, dtype=dtype)
        self.bias = _param(self.output_size_per_rank, dtype=dtype) if bias else None

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out_per_rank={self.output_size_per_rank}, tp={self.tp_size}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (bi.linear if self.batch_invariant else linear)(x, self.weight, self.bias)
        if self.lora is not None:
            y = self.lora.apply(x, y)
        return self.group.all_gather(y, dim=-1) if self.gather_output else y

    # ---- LoRA (model/lora/): the adapter's A and B cut as this layer's weight is ----
    def lora_part_sizes(self) -> list[int]:
        """This rank's output columns of each part an adapter targets separately."""
        return [self.output_size_per_rank]

    def lora_shard(self, part, a: Loaded, b: Loaded) -> tuple[torch.Tensor, torch.Tensor]:
        """All of A ([r, in]); B's rows of this rank's output ([out, r] -> [n, r])."""
        n = self.output_size_per_rank
        return read_all(a), read_range(b, 0, self.tp_rank * n, (self.tp_rank + 1) * n)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id=None) -> None:
        """Rows [rank * n, (rank + 1) * n) of the full weight (or bias)."""
        full = (self.output_size,) + tuple(param.shape[1:])
        check_shape(loaded, full, type(self).__name__)
        n = self.output_size_per_rank
        copy_into(param.data, read_range(loaded, 0, self.tp_rank * n, (self.tp_rank + 1) * n))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stored as one (SwiGLU's gate and up).

    The local weight is [shard of matrix 0; shard of matrix 1; ...], so one
    matmul serves all of them; `shard_id` says which checkpoint matrix is being
    loaded.
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], group, bias: bool = False,
                 dtype: torch.dtype | None = None):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(self.output_sizes), group, bias=bias, dtype=dtype)
        self.local_sizes = [divide(s, self.tp_size, "merged output size") for s in self.output_sizes]

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: int | str = None) -> None:
        """`shard_id` i: the checkpoint's matrix i alone; FUSED: all of them stacked in one
        checkpoint tensor (Phi-3's gate_up_proj), each cut as if it came alone."""
        if shard_id == FUSED:
            check_shape(loaded, (self.output_size,) + tuple(param.shape[1:]), "fused merged parts")
            for part in range(len(self.output_sizes)):
                self._load_part(param, loaded, part, sum(self.output_sizes[:part]))
            return
        if shard_id is None or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"MergedColumnParallelLinear needs shard_id in 0..{len(self.output_sizes) - 1}")
        check_shape(loaded, (self.output_sizes[shard_id],) + tuple(param.shape[1:]), f"merged part {shard_id}")
        self._load_part(param, loaded, shard_id, 0)

    def _load_part(self, param: nn.Parameter, loaded: Loaded, part: int, base: int) -> None:
        """Part `part`'s rows of this rank, read from `loaded` where that part starts at row `base`."""
        n = self.local_sizes[part]
        offset = sum(self.local_sizes[:part])
        start = base + self.tp_rank * n
        copy_into(param.data[offset : offset + n], read_range(loaded, 0, start, start + n))

    def lora_part_sizes(self) -> list[int]:
        return list(self.local_sizes)

    def lora_shard(self, part: int, a: Loaded, b: Loaded) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.local_sizes[part]
        return read_all(a), read_range(b, 0, self.tp_rank * n, (self.tp_rank + 1) * n)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matrix, split by attention heads.

    Query heads are divided evenly. Key/value heads too when there are at least
    as many as ranks; when TP exceeds num_kv_heads each rank holds one KV head,
    replicated on tp / num_kv_heads ranks (as vLLM does), and it is the KV head
    that this rank's query heads use under grouped-query attention.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, group,
                 bias: bool = False, dtype: torch.dtype | None = None):
        tp = group.world_size
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.num_heads_per_rank = divide(num_heads, tp, "num_attention_heads")
        if tp >= num_kv_heads:
            divide(tp, num_kv_heads, "tensor parallel size (KV head replication)")
            self.num_kv_heads_per_rank = 1
            self.kv_head_start = group.rank_in_group // (tp // num_kv_heads)
        else:
            self.num_kv_heads_per_rank = divide(num_kv_heads, tp, "num_key_value_heads")
            self.kv_head_start = group.rank_in_group * self.num_kv_heads_per_rank
        self.q_size = self.num_heads_per_rank * head_dim
        self.kv_size = self.num_kv_heads_per_rank * head_dim
        # The local output is q_size + 2 * kv_size; expressed as a "global" size
        # so the parent allocates exactly that shard.
        super().__init__(hidden_size, (self.q_size + 2 * self.kv_size) * tp, group, bias=bias, dtype=dtype)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: str = None) -> None:
        """`shard_id` 'q', 'k' or 'v': that checkpoint tensor alone; FUSED: one checkpoint tensor
        of q's rows, then k's, then v's (Phi-3's qkv_proj), each cut as if it came alone."""
        rest = tuple(param.shape[1:])
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == FUSED:
            check_shape(loaded, (q + 2 * kv,) + rest, "qkv_proj")
            for part, base in (("q", 0), ("k", q), ("v", q + kv)):
                self._load_part(param, loaded, part, base)
        elif shard_id in ("q", "k", "v"):
            check_shape(loaded, (q if shard_id == "q" else kv,) + rest, f"{shard_id}_proj")
            self._load_part(param, loaded, shard_id, 0)
        else:
            raise ValueError(f"QKVParallelLinear needs shard_id 'q', 'k', 'v' or {FUSED!r}, got {shard_id!r}")

    def _load_part(self, param: nn.Parameter, loaded: Loaded, part: str, base: int) -> None:
        """This rank's heads of `part`, read from `loaded` where that part starts at row `base`."""
        if part == "q":
            start, offset, size = self.tp_rank * self.q_size, 0, self.q_size
        else:
            start = self.kv_head_start * self.head_dim
            offset = self.q_size + (0 if part == "k" else self.kv_size)
            size = self.kv_size
        copy_into(param.data[offset : offset + size], read_range(loaded, 0, base + start, base + start + size))

    def lora_part_sizes(self) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]

    def lora_shard(self, part: int, a: Loaded, b: Loaded) -> tuple[torch.Tensor, torch.Tensor]:
        """B's rows of this rank's heads: its query heads for q (part 0), its KV head(s) for k
        and v (replicated like the weight when TP exceeds the KV heads)."""
        if part == 0:
            start, size = self.tp_rank * self.q_size, self.q_size
        else:
            start, size = self.kv_head_start * self.head_dim, self.kv_size
        return read_all(a), read_range(b, 0, start, start + size)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split over the group.

    The input arrives already split (the output of a column-parallel layer);
    each rank's partial product is summed by an all-reduce. The bias is added
    once, after the reduce, so it is not counted tp times.
    """

    packable_weight = True
    batch_invariant = False  # a fixed chunked reduction tree instead of the all-reduce
    lora = None  # a LinearLoRA when the engine serves adapters (model/lora/)
    compile_group = -1  # compiled_layers.register_group's number for `group`, set when layers are compiled

    def __init__(self, input_size: int, output_size: int, group, bias: bool = False,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.group = group
        self.tp_size = group.world_size
        self.tp_rank = group.rank_in_group
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_rank = divide(input_size, self.tp_size, "input size")
        self.weight = _param(output_size, self.input_size_per_rank, dtype=dtype)
        self.bias = _param(output_size, dtype=dtype) if bias else None
        self.slices_batch_hint: int | None = None  # set by pack_slices
        self._slices: tuple | None = None

    def extra_repr(self) -> str:
        return f"in_per_rank={self.input_size_per_rank}, out={self.output_size}, tp={self.tp_size}"

    def pack_slices(self, batch_hint: int) -> None:
        """Batch-invariant mode: oneDNN-packed copies of the weight's K slices from now on (built
        now, at load time, so the memory they take is counted before the KV cache is sized;
        again after every load). The dense weight stays what loads, updates and a trainer
        see; the copies cost its size again."""
        self.slices_batch_hint, self._slices = batch_hint, None
        self._invariant_slices()

    def drop_packed(self) -> None:
        self._slices = None

    def _invariant_slices(self) -> list[torch.Tensor] | None:
        if self.slices_batch_hint is None or self.weight.numel() == 0:
            return None
        key = (self.weight.data_ptr(), self.weight.device)
        if self._slices is None or self._slices[0] != key:
            n = bi.chunks_per_rank(self.tp_size)
            reorder = torch.ops.mkldnn._reorder_linear_weight
            self._slices = (key, [reorder(w.contiguous(), self.slices_batch_hint)
                                  for w in self.weight.detach().chunk(n, dim=-1)])
        return self._slices[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            y = bi.row_parallel_linear(x, self.weight, self.group, self._invariant_slices())
        elif self.tp_size > 1 and torch.compiler.is_compiling():  # the collective stays out of the graph
            y = torch.ops.spmd_engine.all_reduce(linear(x, self.weight), self.compile_group)
        else:
            y = self.group.all_reduce(linear(x, self.weight))
        y = y + self.bias if self.bias is not None else y
        return y if self.lora is None else self.lora.apply(x, y)

    def lora_part_sizes(self) -> list[int]:
        return [self.output_size]

    def lora_shard(self, part, a: Loaded, b: Loaded) -> tuple[torch.Tensor, torch.Tensor]:
        """A's columns of this rank's input ([r, in] -> [r, n]); all of B (its rank-r products
        are summed over the group first: LinearLoRA)."""
        n = self.input_size_per_rank
        return read_range(a, 1, self.tp_rank * n, (self.tp_rank + 1) * n), read_all(b)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id=None) -> None:
        if param.dim() == 1:  # the bias: replicated
            check_shape(loaded, (self.output_size,), "row-parallel bias")
            copy_into(param.data, read_all(loaded))
            return
        check_shape(loaded, (self.output_size, self.input_size), "RowParallelLinear")
        n = self.input_size_per_rank
        copy_into(param.data, read_range(loaded, 1, self.tp_rank * n, (self.tp_rank + 1) * n))
        self._slices = None  # the packed slices no longer match
