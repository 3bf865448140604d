"""The mixture-of-experts part of `plan`: which groups carry MoE traffic, and expert placement.

Follows moe.py's choice: within a replica the experts' partial outputs are
all-reduced (over TP without EP, over the EP group with it); across DP
replicas (with EP, or without it: each expert's width over the DP x TP ranks,
the EP-shaped group) each sparse layer first all-gathers tokens and routing
over the DP group. With a model (`--model`), the experts each EP rank holds.
"""

from __future__ import annotations

from spmd_engine.model.spec import ModelSpec
from spmd_engine.topology import Layout, group_table


def moe_plan(layout: Layout, expert_parallel: bool, spec: ModelSpec | None = None) -> dict:
    """JSON-able facts: per-layer collectives by group, and (with a MoE spec) experts per rank."""
    ep = expert_parallel and (spec is None or spec.moe is not None)
    across_dp = layout.dp * layout.pcp > 1  # without EP too: each expert's width over DP x TP
    traffic = []
    if across_dp:
        traffic.append({"group": "dp", "op": "all_gather", "what": "tokens + routing (dispatch)"})
    traffic.append({"group": "ep" if ep or across_dp else "tp", "op": "all_reduce",
                    "what": "expert outputs (combine)" + (", each rank keeps its rows" if traffic else "")})
    plan: dict = {"expert_parallel": ep, "width_over_dp": across_dp and not ep,
                  "traffic_per_sparse_layer": traffic}
    if spec is not None and spec.moe is not None:
        m = spec.moe
        sparse = sum(spec.is_moe_layer(i) for i in range(spec.num_layers))
        plan.update(architecture=spec.architecture, num_experts=m.num_experts, top_k=m.top_k,
                    sparse_layers=sparse, num_layers=spec.num_layers)
        if ep:
            per = m.num_experts // (layout.dp * layout.pcp * layout.tp)
            plan["experts_per_rank"] = {
                rank: [i * per, (i + 1) * per - 1]
                for group in group_table(layout, "ep") for i, rank in enumerate(group)}
        else:
            plan["expert_width_per_rank"] = m.expert_intermediate_size // (
                layout.tp * (layout.dp * layout.pcp if across_dp else 1))
    return plan


def render_moe_plan(plan: dict) -> str:
    head = "mixture of experts"
    if "architecture" in plan:
        head += (f" ({plan['architecture']}: {plan['num_experts']} experts, top-{plan['top_k']}, "
                 f"{plan['sparse_layers']} of {plan['num_layers']} layers sparse)")
    mode = ("expert parallel: whole experts on the EP group's ranks" if plan["expert_parallel"]
            else "no expert parallelism: every expert's width split over the DP x TP ranks (the ep group)"
            if plan.get("width_over_dp") else "no expert parallelism: every expert's width split over TP")
    lines = [head, f"  {mode}", "  traffic per sparse layer:"]
    lines += [f"    {t['group']:<3} {t['op']} of {t['what']}" for t in plan["traffic_per_sparse_layer"]]
    if "experts_per_rank" in plan:
        ranks = list(plan["experts_per_rank"].items())
        shown = "  ".join(f"rank {r}: {a}-{b}" for r, (a, b) in ranks[:16])
        lines.append(f"  experts per EP rank: {shown}" + (" ..." if len(ranks) > 16 else ""))
    elif "expert_width_per_rank" in plan:
        lines.append(f"  expert width per rank: {plan['expert_width_per_rank']}")
    return "\n".join(lines)
