"""Versioned, all-or-nothing weight updates: start_weight_update() ... load_weights ...
finish_weight_update(weight_version) (vLLM's names and arguments).

A trainer pushes a new policy as many load_weights batches; in between, the engine
holds a mix of the old and the new weights, so it refuses to generate from
start to finish. Every rank watches its own loads (a failed one, or tensors
left out after a failure, is a reason it cannot serve), and finish decides for
the whole engine: the workers' reasons (all of them under uni and mp, DP
replicas included; under external_launcher each rank's, gathered over its TP,
then PP, then DP group, so every rank of every DP replica reaches the same
verdict, as one LLM driving DP replicas under mp does). Any reason fails the update on every
rank: each marks all its tensors unwritten, and generate raises until an update
that writes every tensor again completes. Nothing half-applied is served; the
version of a completed update is what RequestOutput.weight_version reports. As in
vLLM, finish without a version keeps the one before, and update_weight_version(v)
names the weights without an update; get_weight_version() is "default" before any.
"""

from __future__ import annotations

from spmd_engine.config import ConfigError


class WeightUpdates:
    def __init__(self, engine, external_launcher: bool):
        self._engine = engine
        self._external = external_launcher
        self.version: int | str | None = None  # of the last completed update
        self._started = False
        self._front_end_error: str | None = None  # a load this process refused before the workers saw it
        self.failed: str | None = None  # why the last update did not complete

    def start(self) -> None:
        if self._started:
            raise RuntimeError("a weight update is in progress: finish_weight_update() before starting another")
        self._engine.collective_rpc("start_weight_update")
        self._started, self._front_end_error = True, None

    @property
    def in_progress(self) -> bool:
        """Between start and finish (update_weights of a weight transfer belongs there)."""
        return self._started

    def note_load_error(self, exc: BaseException) -> None:
        """A load_weights call that failed in this process (checked before any worker ran it)."""
        if self._started and self._front_end_error is None:
            self._front_end_error = f"{type(exc).__name__}: {exc}"

    def finish(self, weight_version: int | str | None = None) -> None:
        if not self._started:
            raise RuntimeError("finish_weight_update() without start_weight_update()")
        version = self.version if weight_version is None else _checked_version(weight_version)
        self._started = False
        try:
            problems = [p for p in self._engine.collective_rpc("finish_weight_update") if p]
            if self._front_end_error:
                problems.insert(0, f"this process: {self._front_end_error}")
            if self._external:
                problems = _replica_union(version, problems)
            if problems:  # only an update that writes every tensor again can complete
                self._engine.collective_rpc("mark_weights_mixed")
        except BaseException as exc:  # a peer that died or hung: the outcome is unknown, so it failed
            self.failed = f"weight update {version!r} could not be agreed on: {exc}"
            raise
        if problems:
            self.failed = (f"weight update {version!r} did not complete ({problems[0]}"
                           + (f"; and {len(problems) - 1} more" if len(problems) > 1 else "") + ")")
            raise RuntimeError(self.failed + ": no rank serves it; start_weight_update(), load every "
                               "tensor, finish_weight_update() to recover")
        self.version, self.failed = version, None

    def get_version(self) -> int | str:
        return "default" if self.version is None else self.version

    def set_version(self, version: int | str) -> None:
        self.version = _checked_version(version)

    def check_can_generate(self) -> None:
        if self._started:
            raise RuntimeError("a weight update is in progress (start_weight_update): "
                               "call finish_weight_update() before generate")
        if self.failed:
            raise RuntimeError(f"{self.failed}: the weights are a mix of two policies; start_weight_update(), "
                               f"load every tensor, finish_weight_update() before generate")


def _checked_version(version) -> int | str:
    if isinstance(version, bool) or not isinstance(version, (int, str)):
        raise ConfigError(f"weight version must be an int or a str, got {version!r}")
    return version


def _replica_union(version, problems: list[str]) -> list[str]:
    """Every rank's problems, on every rank of the DP replicas: over TP, then PP, then DP (each
    round carries the union of the rounds before, and together they connect every rank). The
    versions must agree too. External-DP replicas are separate engines: each decides alone."""
    from spmd_engine.distributed import get_dp_group, get_pp_group, get_tp_group
    mine = (version, problems)
    for group in (get_tp_group(), get_pp_group(), get_dp_group()):
        gathered = group.all_gather_object(mine)
        versions = [v for v, _ in gathered]
        merged = [p for _, ps in gathered for p in ps]
        if len(set(map(repr, versions))) > 1:
            merged.insert(0, f"ranks {group.ranks} finished different versions {versions}")
        mine = (version, list(dict.fromkeys(merged)))
    return mine[1]
