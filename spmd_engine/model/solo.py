"""The trivial one-rank group.

Model code takes its TP and PP groups explicitly. When a model runs whole in one
process (the training script, test references) it still needs a group object;
this one has the same attributes as `spmd_engine.distributed.GroupCoordinator`
at size 1, and its collectives are identities.
"""

from __future__ import annotations

import torch


class SoloGroup:
    world_size = 1
    rank_in_group = 0
    is_first_rank = True
    is_last_rank = True
    ranks = [0]

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return tensor
