"""What each rank of a layout holds: the engine's own model, built on the meta device.

A rank loads its architecture's class (`CausalLM`, `Gemma3ForCausalLM`, ...) at its TP, PP and
MoE group coordinates. Built on the
meta device it has every parameter's shape and dtype and no storage, so its
bytes are exact (the padded vocabulary, KV heads replicated when TP exceeds
them, the stage's layers, the last stage's head or tied embedding, the rank's
experts or expert widths) without a second copy of the sharding rules, and
without weights or a GPU. Ranks at the same coordinates share one build.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from spmd_engine import topology as topo
from spmd_engine.model.partition import moe_sharding
from spmd_engine.topology import Layout


@dataclass(frozen=True)
class ShapeGroup:
    """What the model classes read of a process group while they build: its size and our place."""

    world_size: int
    rank_in_group: int

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1


@dataclass(frozen=True)
class RankModel:
    weight_bytes: int  # parameters and buffers, each shared tensor once (a tied head is the embedding)
    kv_bytes_per_token: int  # K and V of one token in this stage's layers, this rank's heads
    kv_bytes_by_window: tuple = ()  # (window, bytes) of each KV group's layers (core/kv_groups.py)


class RankModels:
    """Per-rank models of one checkpoint at one dtype, memoised across layouts."""

    def __init__(self, hf_config: Mapping[str, Any], dtype: torch.dtype, is_moe: bool, packed: bool = False):
        """`packed`: the ranks pack their linear weights for oneDNN (CPU, packed_weights.py), which
        gives a tied LM head a copy of its own beside the embedding."""
        self.hf_config, self.dtype, self.is_moe, self.packed = hf_config, dtype, is_moe, packed
        self._built: dict[tuple, RankModel] = {}

    def for_layout(self, layout: Layout, parallel_config, dp_waves: bool,
                   pp_partition: str | Sequence[int] | None) -> list[RankModel]:
        """One RankModel per launched rank, in rank order."""
        axis, expert_parallel = moe_sharding(parallel_config, dp_waves)
        partition = tuple(pp_partition) if isinstance(pp_partition, list) else pp_partition
        out = []
        for rank in range(layout.launched_world_size):
            c = topo.rank_to_coord(layout, rank)
            moe = None
            if self.is_moe:
                group = topo.group_of(layout, axis, rank)
                moe = (len(group), group.index(rank), expert_parallel)
            key = (layout.tp, c.tp, layout.pp, c.pp, partition, moe)
            if key not in self._built:
                self._built[key] = self._build(*key)
            out.append(self._built[key])
        return out

    def _build(self, tp: int, tp_rank: int, pp: int, pp_rank: int, partition, moe) -> RankModel:
        from spmd_engine.model.registry import ModelRegistry
        from spmd_engine.model.spec import architecture_of
        # The class the ranks build (a family's own layers: OLMo 2's norms, say).
        model_cls, _ = ModelRegistry.resolve_model_cls(architecture_of(self.hf_config, "config.json"))
        tp_group = ShapeGroup(tp, tp_rank)
        moe_args = {}
        if moe is not None:
            size, index, expert_parallel = moe
            moe_args = {"moe_group": ShapeGroup(size, index), "expert_parallel": expert_parallel}
        model = model_cls(self.hf_config, tp_group, ShapeGroup(pp, pp_rank), dtype=self.dtype, device="meta",
                         pp_partition=partition, **moe_args)
        tensors = [*model.parameters(), *model.buffers()]
        weight_bytes = sum(_nbytes(t) for t in tensors)
        if self.packed:
            holders = Counter(id(p) for m in model.modules() for p in m._parameters.values() if p is not None)
            weight_bytes += sum(_nbytes(m.weight) for m in model.modules()
                                if getattr(m, "packable_weight", False) and holders[id(m.weight)] > 1)
        from spmd_engine.core.kv_groups import bytes_by_window
        return RankModel(weight_bytes, model.kv_bytes_per_token(), tuple(bytes_by_window(model).items()))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
