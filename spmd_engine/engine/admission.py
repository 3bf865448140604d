"""SPMD admission: every rank of a replica adds the same requests at the same step.

Under external_launcher each rank runs its own scheduler, and they only stay in
step (same batches, same collectives) if each sees the same adds and aborts in
the same order between the same two steps. Adds and aborts are therefore
queued, and applied at the next sync point (step, has_unfinished_requests,
get_num_unfinished_requests, pause_generation), after an exchange over the
replica's CPU groups (TP, then PCP, then PP: together they connect the replica):

- admission="identical" (the default): every rank adds the same requests itself.
  The ranks compare digests of what they queued; any difference is a ConfigError
  on every rank, and nothing queued is applied (never a divergent schedule).
- admission="rank0": only the replica's first rank takes requests and aborts
  from its caller; they travel to the other ranks in the exchange.

Either way the ranks also compare their engine seeds, whether they are paused,
and a digest of the last step each applied (its schedule and sampled tokens), so
a divergence that slipped through shows at the next step, on every rank. An
error found by any rank in any round is carried through the later rounds, so
every rank raises. Under uni and mp there is one front end and nothing to
exchange: the queue is applied at once.
"""

from __future__ import annotations

import hashlib
import pickle

from spmd_engine.config import ConfigError

MODES = ("identical", "rank0")


def check_mode(admission: str) -> str:
    if admission not in MODES:
        raise ConfigError(f"admission must be one of {MODES}, got admission={admission!r}")
    return admission


class ReplicaExchange:
    """The sync point of one external_launcher rank."""

    def __init__(self, mode: str, seed: int):
        from spmd_engine.distributed import get_pcp_group, get_pp_group, get_tp_group
        self.mode, self.seed = mode, seed
        self.groups = [g for g in (get_tp_group(), get_pcp_group(), get_pp_group()) if g.world_size > 1]
        self.is_first_rank = all(g.is_first_rank for g in (get_tp_group(), get_pcp_group(), get_pp_group()))

    @property
    def takes_input(self) -> bool:
        return self.mode == "identical" or self.is_first_rank

    def exchange(self, queued: list[tuple], paused: bool, step_digest: str) -> list[tuple]:
        """The queue every rank of the replica applies now (rank0: the first rank's)."""
        mine = {"seed": self.seed, "queued": _digest(queued), "paused": paused, "step": step_digest,
                "entries": queued if self.mode == "rank0" and self.is_first_rank else None, "errors": []}
        for group in self.groups:
            gathered = group.all_gather_object(mine)
            errors = list(dict.fromkeys(e for g in gathered for e in g["errors"]))
            errors += _differences(group.ranks, gathered, self.mode)
            source = next((g["entries"] for g in gathered if g["entries"] is not None), None)
            mine = {**mine, "entries": source, "errors": list(dict.fromkeys(errors))}
        if mine["errors"]:
            raise ConfigError("; ".join(mine["errors"]))
        return queued if self.mode == "identical" else mine["entries"] or []


def _differences(ranks: list[int], gathered: list[dict], mode: str) -> list[str]:
    out = []
    seeds = [g["seed"] for g in gathered]
    if len(set(seeds)) > 1:
        out.append(f"ranks {ranks} have engine seeds {seeds}: every rank of a replica must pass the "
                   f"same LLM(seed=...), or their samples differ")
    for key, what in (("queued", "passed different prompts or sampling params, or aborts, than"),
                      ("paused", "are paused differently from"), ("step", "scheduled or sampled differently from")):
        if key == "queued" and mode == "rank0":
            continue  # only the first rank's queue counts
        odd = [ranks[i] for i, g in enumerate(gathered) if g[key] != gathered[0][key]]
        if odd:
            out.append(f"ranks {odd} {what} rank {ranks[0]}; every rank of a replica must pass the same "
                       f"requests in the same order, and call step() the same number of times")
    return out


def _digest(queued: list[tuple]) -> str:
    identity = [(kind, item.identity() if kind == "add" else item) for kind, item in queued]
    return hashlib.sha256(pickle.dumps(identity)).hexdigest()
