"""The launch plan as data (the `plan --json` object) and as a picture a person reads.

Everything here derives from topology.py; nothing is computed twice. The JSON
shape is a contract scripts depend on, so its keys are fixed.
"""

from __future__ import annotations

from spmd_engine import topology as topo
from spmd_engine.topology import Layout


def plan_dict(layout: Layout, backend: str, nnodes: int = 1) -> dict:
    ranks = []
    for rank in range(layout.launched_world_size):
        c = topo.rank_to_coord(layout, rank)
        ranks.append({
            "rank": rank, "tp": c.tp, "pp": c.pp, "pcp": c.pcp, "dp": c.dp,
            "external_dp": c.external_dp,
            "device_index": topo.device_index(layout, backend, rank, nnodes),
        })
    procs = topo.process_plan(layout, backend)
    return {
        "tensor_parallel_size": layout.tp,
        "pipeline_parallel_size": layout.pp,
        "data_parallel_size": layout.dp,
        "prefill_context_parallel_size": layout.pcp,
        "decode_context_parallel_size": layout.dcp,
        "world_size": layout.world_size,
        "world_size_across_dp": layout.world_size_across_dp,
        "external_data_parallel_size": layout.external_dp,
        "distributed_executor_backend": backend,
        "output_rank": topo.output_rank(layout),
        "ranks": ranks,
        "groups": {axis: topo.group_table(layout, axis) for axis in ("tp", "pp", "dp", "pcp", "dcp", "ep")},
        "processes": {
            "engine_cores": procs.engine_cores,
            "workers_per_engine_core": procs.workers_per_engine_core,
            "dp_coordinator": procs.dp_coordinator,
            "total": procs.total,
        },
    }


def _grid_block(layout: Layout, replica: int) -> list[str]:
    """One replica's ranks as a PP x (PCP, TP) table; the output rank in brackets."""
    first = topo.replica_first_rank(layout, replica)
    out = first + topo.output_rank(layout)
    cols = [(pcp, tp) for pcp in range(layout.pcp) for tp in range(layout.tp)]
    head = "".join(f"{('pcp%d.' % p if layout.pcp > 1 else '') + 'tp%d' % t:>8}" for p, t in cols)
    lines = [f"{'':6}{head}"]
    for pp in range(layout.pp):
        cells = []
        for pcp, tp in cols:
            rank = first + (pp * layout.pcp + pcp) * layout.tp + tp
            cells.append(f"{('[%d]' % rank) if rank == out else str(rank):>8}")
        lines.append(f"  pp{pp:<2}" + "".join(cells))
    return lines


def _replica_title(layout: Layout, replica: int, backend: str) -> str:
    edp, dp = divmod(replica, layout.dp)
    if backend == "external_launcher":
        return f"external DP {edp}, DP {dp}" if layout.external_dp > 1 else f"DP replica {dp}"
    return f"DP replica {dp} ({topo.engine_core_name(dp, layout.dp)})"


def _fmt_groups(groups: list[list[int]], limit: int = 8) -> str:
    shown = " ".join(str(g) for g in groups[:limit])
    return shown + (f" ... ({len(groups)} groups)" if len(groups) > limit else "")


def render_plan(layout: Layout, backend: str, nnodes: int = 1, expert_parallel: bool = False) -> str:
    d = plan_dict(layout, backend, nnodes)
    lines = [
        f"spmd_engine plan  TP={layout.tp} PP={layout.pp} PCP={layout.pcp} DCP={layout.dcp} "
        f"DP={layout.dp} external-DP={layout.external_dp}  backend={backend}",
        f"world_size (TP x PP x PCP) = {layout.world_size}   world_size_across_dp = "
        f"{layout.world_size_across_dp}   launched ranks = {layout.launched_world_size}",
        "",
        "rank grid   rank = dp*(pp_size*tp_size) + pp*tp_size + tp"
        + ("   (PCP between PP and TP)" if layout.pcp > 1 else ""),
    ]
    for replica in range(layout.num_replicas):
        lines.append(f"  {_replica_title(layout, replica, backend)}")
        lines.extend("  " + row for row in _grid_block(layout, replica))
    lines.append(f"  [n] = output rank: first TP rank of the last PP stage, "
                 f"{topo.output_rank(layout)} within each replica")
    lines += ["", "groups (each axis partitions the world; size-1 axes are real, degenerate groups)"]
    for axis in ("tp", "pp", "dp", "pcp", "dcp", "ep"):
        note = "" if axis != "ep" or expert_parallel else "   (built only with --enable-expert-parallel)"
        lines.append(f"  {axis:<3} {_fmt_groups(d['groups'][axis])}{note}")
    lines += ["", f"{'rank':>6} {'coord (edp,dp,pp,pcp,tp)':>26} {'device':>7}  tp / pp / dp group"]
    device_prefix = "cuda:"
    for r in d["ranks"][:64]:
        rank = r["rank"]
        coord = f"({r['external_dp']},{r['dp']},{r['pp']},{r['pcp']},{r['tp']})"
        mine = " / ".join(str(topo.group_of(layout, a, rank)) for a in ("tp", "pp", "dp"))
        lines.append(f"{rank:>6} {coord:>26} {device_prefix}{r['device_index']:<3}  {mine}")
    if layout.launched_world_size > 64:
        lines.append(f"{'':>6} ... {layout.launched_world_size - 64} more ranks")
    lines += ["", _render_processes(layout, backend, d["processes"])]
    return "\n".join(lines)


def _render_processes(layout: Layout, backend: str, procs: dict) -> str:
    lines = [f"processes ({backend}): {procs['total']} in all"]
    if backend == "external_launcher":
        lines.append(f"  the launcher starts {layout.launched_world_size} processes; each is an engine "
                     f"with one in-process worker (device = LOCAL_RANK)")
        return "\n".join(lines)
    if backend == "uni":
        lines.append("  one process: engine core and its worker run in the launching process")
        return "\n".join(lines)
    front = "launching process: front end"
    if procs["dp_coordinator"]:
        front += " + DP coordinator (spreads prompts over replicas, gathers results)"
        lines.append("  " + front)
    for dp, name in enumerate(procs["engine_cores"]):
        devices = [topo.device_index_mp(layout, local, dp) for local in range(layout.world_size)]
        where = "in the launching process" if layout.dp == 1 else "own process"
        lines.append(f"  {name} ({where}) -> {procs['workers_per_engine_core']} workers, "
                     f"devices {devices[0]}..{devices[-1]}")
    return "\n".join(lines)
