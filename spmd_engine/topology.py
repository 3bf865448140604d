"""Pure rank arithmetic: no process groups, no torch, nothing of ours imported.

The launched world is a row-major grid over the axes [external_dp, dp, pp, pcp, tp]
(TP fastest). With PCP = 1 that is vLLM's
``rank = dp * (pp_size * tp_size) + pp * tp_size + tp``. A group on an axis is
every rank that shares all the other coordinates; each axis's groups therefore
partition the world. Keeping this math free of side effects lets the plan CLI,
the distributed runtime and the tests share one definition.
"""

from __future__ import annotations

from dataclasses import dataclass

AXES = ("external_dp", "dp", "pp", "pcp", "tp")
GROUP_AXES = ("tp", "dcp", "pcp", "pp", "dp", "ep")


class TopologyError(ValueError):
    """The launched world does not fit the requested sizes."""


# Each axis's size as the errors name it; ParallelConfig passes its own field names.
SIZE_NAMES = {"tp": "tp size", "pp": "pp size", "pcp": "pcp size", "dcp": "dcp size", "dp": "dp size",
              "external_dp": "external_dp size"}


def check_sizes(sizes: dict[str, object], names: dict[str, str], error: type[Exception] = TopologyError) -> None:
    """The one rule for a layout's sizes, whoever holds them: each an integer >= 1, and DCP
    dividing TP (DCP splits a TP group's KV cache). `names` says how the errors name each axis."""
    for axis, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise error(f"{names[axis]} must be an integer >= 1, got {value!r}")
    if sizes.get("tp", 1) % sizes.get("dcp", 1):
        raise error(f"{names['dcp']} ({sizes['dcp']}) must divide {names['tp']} ({sizes['tp']})")


@dataclass(frozen=True)
class Layout:
    """Sizes of every axis of one launch; the shape of the rank grid."""

    tp: int = 1
    pp: int = 1
    pcp: int = 1
    dcp: int = 1
    dp: int = 1
    external_dp: int = 1

    def __post_init__(self) -> None:
        check_sizes({axis: getattr(self, axis) for axis in SIZE_NAMES}, SIZE_NAMES)

    @classmethod
    def for_world(cls, launched_world: int, tp: int = 1, pp: int = 1, pcp: int = 1,
                  dcp: int = 1, dp: int = 1) -> "Layout":
        """The layout of a launch of `launched_world` ranks; the surplus factor is external DP."""
        needed = tp * pp * pcp * dp
        if launched_world < 1 or launched_world % needed:
            raise TopologyError(
                f"world size {launched_world} is not a multiple of "
                f"TP x PP x PCP x DP = {tp}x{pp}x{pcp}x{dp} = {needed}"
            )
        return cls(tp=tp, pp=pp, pcp=pcp, dcp=dcp, dp=dp, external_dp=launched_world // needed)

    @classmethod
    def of(cls, parallel_config, launched_world: int | None = None) -> "Layout":
        """The layout of a ParallelConfig (read by its attribute names: this module imports
        nothing of ours), in a launch of `launched_world` ranks (None: no external DP)."""
        pc = parallel_config
        tp, pp, pcp, dp = (pc.tensor_parallel_size, pc.pipeline_parallel_size,
                           pc.prefill_context_parallel_size, pc.data_parallel_size)
        world = tp * pp * pcp * dp if launched_world is None else launched_world
        return cls.for_world(world, tp=tp, pp=pp, pcp=pcp, dcp=pc.decode_context_parallel_size, dp=dp)

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.external_dp, self.dp, self.pp, self.pcp, self.tp)

    @property
    def world_size(self) -> int:
        """Ranks of one DP replica: TP x PP x PCP."""
        return self.tp * self.pp * self.pcp

    @property
    def world_size_across_dp(self) -> int:
        return self.world_size * self.dp

    @property
    def launched_world_size(self) -> int:
        return self.world_size_across_dp * self.external_dp

    @property
    def num_replicas(self) -> int:
        """Whole-engine copies: DP replicas times external-DP replicas."""
        return self.dp * self.external_dp


@dataclass(frozen=True)
class Coord:
    """One rank's position in the grid."""

    external_dp: int
    dp: int
    pp: int
    pcp: int
    tp: int



def rank_to_coord(layout: Layout, rank: int) -> Coord:
    if not 0 <= rank < layout.launched_world_size:
        raise TopologyError(f"rank {rank} outside world of {layout.launched_world_size}")
    rest = rank
    values = []
    for size in reversed(layout.shape):
        values.append(rest % size)
        rest //= size
    ext, dp, pp, pcp, tp = reversed(values)
    return Coord(ext, dp, pp, pcp, tp)


def replica_index(layout: Layout, coord: Coord) -> int:
    """Index of a rank's engine copy among all DP x external-DP replicas."""
    return coord.external_dp * layout.dp + coord.dp


def coord_to_rank(layout: Layout, coord: Coord) -> int:
    rank = 0
    for size, value in zip(layout.shape, (coord.external_dp, coord.dp, coord.pp, coord.pcp, coord.tp)):
        if not 0 <= value < size:
            raise TopologyError(f"coordinate {coord} outside grid {layout.shape}")
        rank = rank * size + value
    return rank


def _groups_varying(layout: Layout, varying: tuple[str, ...]) -> list[list[int]]:
    """Groups of ranks that share every coordinate except those in `varying`."""
    fixed = [a for a in AXES if a not in varying]
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(layout.launched_world_size):
        coord = rank_to_coord(layout, rank)
        groups.setdefault(tuple(getattr(coord, a) for a in fixed), []).append(rank)
    return sorted(groups.values())


def group_table(layout: Layout, axis: str) -> list[list[int]]:
    """Every group of one axis, each sorted, ordered by first rank.

    Every rank must create every group (new_group is collective) in this same
    order. DCP groups are consecutive chunks of dcp ranks inside a TP group; EP
    spans DP x PCP x TP (everything but the pipeline stage and external DP).
    """
    if axis in ("tp", "pcp", "pp", "dp"):
        return _groups_varying(layout, (axis,))
    if axis == "dcp":
        return [tp_group[i:i + layout.dcp]
                for tp_group in _groups_varying(layout, ("tp",))
                for i in range(0, layout.tp, layout.dcp)]
    if axis == "ep":
        return _groups_varying(layout, ("dp", "pcp", "tp"))
    if axis == "world":
        return [list(range(layout.launched_world_size))]
    raise TopologyError(f"unknown axis {axis!r}; expected one of {GROUP_AXES}")


def group_of(layout: Layout, axis: str, rank: int) -> list[int]:
    """The one group of `axis` that holds `rank`."""
    for group in group_table(layout, axis):
        if rank in group:
            return group
    raise TopologyError(f"rank {rank} is in no {axis} group")  # unreachable for valid ranks


def replica_first_rank(layout: Layout, replica: int) -> int:
    return replica * layout.world_size


def output_rank(layout: Layout) -> int:
    """Rank within a replica whose reply the engine reads: first TP rank of the last stage."""
    return layout.world_size - layout.tp * layout.pcp


def global_output_rank(layout: Layout, replica: int) -> int:
    return replica_first_rank(layout, replica) + output_rank(layout)


def device_index_mp(layout: Layout, local_rank: int, dp_local_rank: int) -> int:
    """Worker.init_device: DP_LOCAL_RANK * TP_PP_WORLD_SIZE + local rank."""
    return local_rank + dp_local_rank * layout.tp * layout.pp


def device_index(layout: Layout, backend: str, rank: int, nnodes: int = 1) -> int:
    """The accelerator index a rank claims on its node.

    mp: each replica's workers count local ranks from 0 and are shifted by a whole
    TP x PP block per local DP replica. external_launcher: torchrun's LOCAL_RANK.
    uni: the single process takes device 0 of its replica's block.
    """
    coord = rank_to_coord(layout, rank)
    if backend == "external_launcher":
        per_node = max(1, layout.launched_world_size // nnodes)
        return rank % per_node
    replicas_per_node = max(1, layout.dp // nnodes)
    local_rank = rank % layout.world_size
    return device_index_mp(layout, local_rank, coord.dp % replicas_per_node)


def engine_core_name(dp_rank: int, dp_size: int) -> str:
    """vLLM's process title: EngineCore at DP = 1, EngineCore_DP{i} otherwise."""
    return f"EngineCore_DP{dp_rank}" if dp_size > 1 or dp_rank > 0 else "EngineCore"


def worker_name(layout: Layout, coord: Coord) -> str:
    """Worker process title: its replica and coordinate, visible in ps."""
    name = "Worker"
    if layout.dp > 1:
        name += f"_DP{coord.dp}"
    name += f"_PP{coord.pp}"
    if layout.pcp > 1:
        name += f"_PCP{coord.pcp}"
    return name + f"_TP{coord.tp}"


@dataclass(frozen=True)
class ProcessPlan:
    """The operating-system processes one launch starts."""

    engine_cores: list[str]
    workers_per_engine_core: int
    dp_coordinator: bool
    total: int


def process_plan(layout: Layout, backend: str) -> ProcessPlan:
    """How many processes a backend starts for this layout.

    uni: everything (engine core and its one worker) runs in the launching
    process. mp: one EngineCore per DP replica, each spawning TP x PP x PCP
    workers; with DP > 1 the launching process stays as the front end and DP
    coordinator and each replica's engine core is its own process.
    external_launcher: the launcher made every process; each is an engine with
    one in-process worker.
    """
    if backend == "external_launcher":
        names = [f"rank{r}" for r in range(layout.launched_world_size)]
        return ProcessPlan(names, 1, False, layout.launched_world_size)
    names = [engine_core_name(i, layout.dp) for i in range(layout.dp)]
    coordinator = layout.dp > 1
    if backend == "uni":
        if layout.world_size != 1:
            raise TopologyError(f"uni runs one worker, but TP x PP x PCP = {layout.world_size}")
        total = 1 if layout.dp == 1 else 1 + layout.dp
        return ProcessPlan(names, 1, coordinator, total)
    if backend == "mp":
        engine_processes = 0 if layout.dp == 1 else layout.dp
        total = 1 + engine_processes + layout.dp * layout.world_size
        return ProcessPlan(names, layout.world_size, coordinator, total)
    raise TopologyError(f"Unknown distributed executor backend: {backend}")
