"""Topology math: the seed's worked examples, then every layout up to world 64."""

import itertools

import pytest

from spmd_engine import topology as topo
from spmd_engine.topology import Coord, Layout, TopologyError

SEED = Layout(tp=2, pp=2, dp=2)


def test_seed_rank_formula_and_grid():
    # rank = dp*(pp_size*tp_size) + pp*tp_size + tp, DP slowest, TP fastest.
    for rank in range(8):
        c = topo.rank_to_coord(SEED, rank)
        assert rank == c.dp * (2 * 2) + c.pp * 2 + c.tp
    # Ranks 0-3 are replica 0, ranks 4-7 replica 1: DP copies the 4-rank grid.
    assert [topo.rank_to_coord(SEED, r).dp for r in range(8)] == [0] * 4 + [1] * 4
    # Rank 1 is (tp=1, pp=0, dp=0); rank 6 is (tp=0, pp=1, dp=1).
    assert topo.rank_to_coord(SEED, 1) == Coord(0, 0, 0, 0, 1)
    assert topo.rank_to_coord(SEED, 6) == Coord(0, 1, 1, 0, 0)


def test_seed_group_tables():
    assert topo.group_table(SEED, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.group_table(SEED, "pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # The row easiest to get backwards: rank 1's DP-mate is 5, not 6.
    assert topo.group_table(SEED, "dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # PCP and DCP exist but degenerate to one rank each.
    assert topo.group_table(SEED, "pcp") == [[r] for r in range(8)]
    assert topo.group_table(SEED, "dcp") == [[r] for r in range(8)]
    # Every axis: 4 groups of size 2 = 8 ranks.
    for axis in ("tp", "pp", "dp"):
        table = topo.group_table(SEED, axis)
        assert len(table) == 4 and all(len(g) == 2 for g in table)


def test_seed_rank3_has_exactly_three_groups():
    assert topo.group_of(SEED, "tp", 3) == [2, 3]
    assert topo.group_of(SEED, "pp", 3) == [1, 3]
    assert topo.group_of(SEED, "dp", 3) == [3, 7]


def test_seed_world_sizes():
    assert SEED.world_size == 4 and SEED.world_size_across_dp == 8
    # TP=1, DP=2: world_size reports 1, world_size_across_dp reports 2.
    dp_only = Layout(dp=2)
    assert dp_only.world_size == 1 and dp_only.world_size_across_dp == 2


def test_seed_output_rank():
    # 4 - 2*1 = 2: local rank 2 is (tp=0, pp=1), first TP worker of the last stage.
    assert topo.output_rank(SEED) == 2
    assert topo.rank_to_coord(SEED, 2) == Coord(0, 0, 1, 0, 0)
    assert topo.global_output_rank(SEED, 1) == 6
    assert topo.output_rank(Layout()) == 0
    assert topo.output_rank(Layout(tp=2, pcp=2, pp=2)) == 4


def test_seed_device_offsets_per_replica():
    # DP_LOCAL_RANK * TP_PP_WORLD_SIZE + local rank: replicas claim disjoint devices.
    assert [topo.device_index_mp(SEED, local, 0) for local in range(4)] == [0, 1, 2, 3]
    assert [topo.device_index_mp(SEED, local, 1) for local in range(4)] == [4, 5, 6, 7]
    assert [topo.device_index(SEED, "mp", r) for r in range(8)] == list(range(8))
    # external launcher: LOCAL_RANK, per node.
    assert [topo.device_index(SEED, "external_launcher", r, nnodes=2) for r in range(8)] == [0, 1, 2, 3] * 2


def test_seed_process_plan():
    mp = topo.process_plan(SEED, "mp")
    assert mp.engine_cores == ["EngineCore_DP0", "EngineCore_DP1"]
    assert mp.workers_per_engine_core == 4 and mp.dp_coordinator
    assert topo.process_plan(Layout(tp=2), "mp").engine_cores == ["EngineCore"]
    assert not topo.process_plan(Layout(tp=2), "mp").dp_coordinator
    assert topo.process_plan(Layout(dp=4), "mp").engine_cores == [f"EngineCore_DP{i}" for i in range(4)]
    assert topo.process_plan(Layout(), "uni").total == 1
    assert topo.process_plan(Layout.for_world(8, tp=2), "external_launcher").total == 8
    with pytest.raises(TopologyError):
        topo.process_plan(Layout(tp=2), "uni")


def test_external_dp_from_launched_world():
    layout = Layout.for_world(8, tp=2)
    assert layout.external_dp == 4 and layout.num_replicas == 4
    assert topo.group_table(layout, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # External DP replicas never coordinate: DP groups are singletons at DP=1.
    assert topo.group_table(layout, "dp") == [[r] for r in range(8)]
    with pytest.raises(TopologyError, match="not a multiple"):
        Layout.for_world(7, tp=2)


def test_dcp_and_ep_tables():
    layout = Layout(tp=4, dcp=2, dp=2, pp=2)
    assert topo.group_table(layout, "dcp")[:2] == [[0, 1], [2, 3]]
    # EP spans DP x PCP x TP with PP (and external DP) fixed.
    assert topo.group_table(layout, "ep")[0] == [0, 1, 2, 3, 8, 9, 10, 11]


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _layouts_of_world(world):
    for tp in _divisors(world):
        for pp in _divisors(world // tp):
            for pcp in _divisors(world // (tp * pp)):
                for dp in _divisors(world // (tp * pp * pcp)):
                    edp = world // (tp * pp * pcp * dp)
                    for dcp in _divisors(tp):
                        yield Layout(tp=tp, pp=pp, pcp=pcp, dcp=dcp, dp=dp, external_dp=edp)


@pytest.mark.parametrize("world", [range(1, 33), range(33, 49), range(49, 57), range(57, 65)],
                         ids=["1-32", "33-48", "49-56", "57-64"])
def test_every_layout_up_to_world_64(world):
    count = 0
    for layout in (lay for w in world for lay in _layouts_of_world(w)):
        count += 1
        world = layout.launched_world_size
        coords = [topo.rank_to_coord(layout, r) for r in range(world)]
        assert [topo.coord_to_rank(layout, c) for c in coords] == list(range(world))
        for axis in ("tp", "dcp", "pcp", "pp", "dp", "ep"):
            table = topo.group_table(layout, axis)
            flat = sorted(itertools.chain.from_iterable(table))
            assert flat == list(range(world)), (layout, axis)  # a partition: each rank exactly once
            size = {"tp": layout.tp, "dcp": layout.dcp, "pcp": layout.pcp, "pp": layout.pp,
                    "dp": layout.dp, "ep": layout.dp * layout.pcp * layout.tp}[axis]
            assert all(len(g) == size for g in table), (layout, axis)
        # Members of a TP group share every coordinate but tp; likewise for DP.
        for axis in ("tp", "pp", "dp", "pcp"):
            for group in topo.group_table(layout, axis):
                keys = {tuple(v for k, v in vars(coords[r]).items() if k != axis) for r in group}
                assert len(keys) == 1
        out = topo.output_rank(layout)
        c = topo.rank_to_coord(layout, out)
        assert (c.pp, c.pcp, c.tp, c.dp, c.external_dp) == (layout.pp - 1, 0, 0, 0, 0)
    assert count > 100
