"""`python -m spmd_engine.plan ... --live` with a corrupted group table: every rank builds its
TP groups from a table with two members swapped between the first two groups (all ranks agree,
so the groups come up), which the live check must report against the plan."""

import sys

from spmd_engine.distributed import parallel_state as ps
from spmd_engine.plan import main as plan

_real = ps.GroupCoordinator


def _corrupted(group_ranks, local_rank, device_backend, group_name, timeout):
    if group_name == "tp" and len(group_ranks) >= 2:
        table = [list(g) for g in group_ranks]
        table[0][-1], table[1][-1] = table[1][-1], table[0][-1]
        group_ranks = [sorted(g) for g in table]
    return _real(group_ranks, local_rank, device_backend, group_name, timeout)


ps.GroupCoordinator = _corrupted

if __name__ == "__main__":
    sys.exit(plan.main(sys.argv[1:]))
