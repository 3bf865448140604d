"""FusedMoE's token exchange across ranks that hold different tokens (as DP replicas do).

Run under torchrun with 2 ranks: each rank routes its own tokens (rank 1 a single
token, like an idle replica's dummy step, rank 0 seven), the layer all-gathers them over
the world, computes its share (whole experts, or every expert's width slice) and keeps
its rows of the all-reduced result, which must equal the unsharded computation of this
rank's tokens. Prints one OK line per mode.
"""

import sys

import torch
import torch.distributed as dist

from spmd_engine.distributed.group_coordinator import GroupCoordinator
from spmd_engine.model.layers.fused_moe import FusedMoE, expert_outputs
from spmd_engine.model.layers.moe_routing import route

EXPERTS, HIDDEN, WIDTH, TOP_K = 4, 16, 8, 2

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = GroupCoordinator([[0, 1]], 0, "gloo", "ep", 60)
    gen = torch.Generator().manual_seed(0)  # the same full weights on every rank
    w1, w3 = torch.randn(2, EXPERTS, WIDTH, HIDDEN, generator=gen)
    w2 = torch.randn(EXPERTS, HIDDEN, WIDTH, generator=gen)
    router = torch.randn(EXPERTS, HIDDEN, generator=gen)
    x = torch.randn(7 if rank == 0 else 1, HIDDEN, generator=torch.Generator().manual_seed(1 + rank))
    weights, ids = route(x @ router.T, TOP_K, True, True)
    expected = expert_outputs(x, weights, ids, torch.cat([w1, w3], dim=1), w2)
    for expert_parallel in (True, False):
        layer = FusedMoE(EXPERTS, HIDDEN, WIDTH, group, expert_parallel=expert_parallel, dispatch_group=group)
        for e in layer.local_experts:
            layer.weight_loader(layer.w13_weight, w1[e], ("w1", e))
            layer.weight_loader(layer.w13_weight, w3[e], ("w3", e))
            layer.weight_loader(layer.w2_weight, w2[e], ("w2", e))
        got = layer(x, weights, ids)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        mode = "ep" if expert_parallel else "tp"
        # One write per line (unbuffered print writes the newline apart: lines would run together).
        sys.stdout.write(f"rank {rank} {mode} experts {list(layer.local_experts)} rows {x.shape[0]} OK\n")
        sys.stdout.flush()
    group.destroy()
    dist.destroy_process_group()
    sys.exit(0)
