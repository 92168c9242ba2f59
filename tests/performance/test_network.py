"""Two-level pricing: each collective on the links it crosses, checked against transfers counted hop
by hop and hand-worked cases (one node as the one-level model: test_iteration_time.py)."""

from __future__ import annotations

import pytest

from dlrm.performance import cost_model as cm
from dlrm.performance import network as net


def _node(rank: int, g: int) -> int:
    return rank // g


def _time(transfers: list[tuple[int, int, float]], g: int, intra: net.Link, inter: net.Link) -> float:
    """Seconds of concurrent transfers (src, dst, bytes): each medium (a rank's own link, or the
    node's shared one) carries what its senders put on it; the slowest medium sets the time."""
    load: dict[tuple, float] = {}
    for src, dst, b in transfers:
        link = inter if _node(src, g) != _node(dst, g) else intra
        key = (link is inter, _node(src, g) if link.shared else src)
        load[key] = load.get(key, 0.0) + b
    times = [
        ((inter if is_inter else intra).latency_s + b / (inter if is_inter else intra).bytes_per_s)
        for (is_inter, _), b in load.items()
    ]
    return max(times, default=0.0)


LINKS = [net.Link(8e6), net.Link(8e6, shared=True)]
SLOW = [net.Link(1e5), net.Link(1e5, shared=True)]


@pytest.mark.parametrize("intra", LINKS)
@pytest.mark.parametrize("inter", SLOW)
@pytest.mark.parametrize("world,g", [(4, 2), (6, 3), (8, 2), (8, 4), (16, 8)])
def test_an_all_to_all_matches_its_transfers_peer_by_peer(world, g, intra, inter):
    per_rank = 4200.0 * (world - 1)
    transfers = [(s, d, per_rank / (world - 1)) for s in range(world) for d in range(world) if s != d]
    topo = net.Topology(g, intra, inter)
    assert topo.seconds(net.Collective("pairwise", per_rank), world) == pytest.approx(_time(transfers, g, intra, inter))
    inside, across = topo.crossing(net.Collective("pairwise", per_rank), world)
    counted_across = sum(b for s, d, b in transfers if _node(s, g) != _node(d, g)) / world
    assert (inside + across, across) == pytest.approx((per_rank, counted_across))


@pytest.mark.parametrize("intra", LINKS)
@pytest.mark.parametrize("inter", SLOW)
@pytest.mark.parametrize("world,g", [(4, 2), (6, 3), (8, 4), (16, 8)])
def test_a_ring_step_waits_for_its_one_crossing_per_node(world, g, intra, inter):
    sent = 5000.0  # every rank sends this to its successor (rank order, nodes contiguous)
    transfers = [(r, (r + 1) % world, sent) for r in range(world)]
    topo = net.Topology(g, intra, inter)
    assert topo.seconds(net.Collective("ring", sent), world) == pytest.approx(_time(transfers, g, intra, inter))


def test_the_emulated_two_nodes_by_hand():
    # 2 nodes x 2 ranks, a veth of 1e6 B/s per direction per node; loopback 1e9 shared.
    # all-to-all of 3,000 B per rank: 1,000 to the node's other rank, 2,000 to the other node;
    # node 0's veth carries 2 ranks x 2,000 = 4,000 B: 4 ms (the loopback's 2,000 B: 2 us).
    topo = net.Topology(2, net.Link(1e9, shared=True), net.Link(1e6, shared=True))
    assert topo.seconds(net.Collective("pairwise", 3000), 4) == pytest.approx(4e-3)
    # ring all-reduce of 1,000 fp32 values: 2 x 3/4 x 4,000 = 6,000 B per rank, one crosser per node
    assert topo.seconds(net.Collective("ring", net.ring_allreduce_bytes(1000, 4)), 4) == pytest.approx(6e-3)


def test_a_hierarchical_all_reduce_by_hand():
    # 8 ranks, 4 per node, 8,000 B of values. Inside: reduce-scatter, each rank sends 3/4 x 8,000 =
    # 6,000 B on its own 6e6 B/s link: 1 ms, and the all-gather again 1 ms. Across 2 nodes each
    # rank all-reduces its 2,000 B shard: a 2-rank ring sends 2 x 1/2 x 2,000 = 2,000 B; 4 ranks on
    # the node's 1e6 B/s NIC: 8,000 B, 8 ms. Total 10 ms.
    topo = net.Topology(4, net.Link(6e6), net.Link(1e6, shared=True))
    assert topo.seconds(net.Collective("hierarchical", 8000), 8) == pytest.approx(10e-3)
    assert topo.crossing(net.Collective("hierarchical", 8000), 8) == pytest.approx((12000, 2000))


def test_a_hierarchical_all_reduce_crosses_less_than_a_ring_on_a_nic_per_rank():
    topo = net.Topology(8, net.Link(300e9), net.Link(25e9))
    values = 3e6
    ring = topo.seconds(net.Collective("ring", net.ring_allreduce_bytes(values, 64, 1.0)), 64)
    hier = topo.seconds(net.Collective("hierarchical", values), 64)
    assert hier < ring / 4


@pytest.mark.parametrize("aggregation", ["allgather", "reduce_scatter"])
@pytest.mark.parametrize("world", [2, 3, 8, 64])
def test_sparse_aggregation_sends_the_cost_models_bytes(aggregation, world):
    parts = net.sparse_aggregation(10_000, world, aggregation, header=88)
    assert sum(c.bytes_per_rank for c in parts) == pytest.approx(
        net.sparse_aggregation_bytes(10_000, world, aggregation, header=88)
    )


def test_two_levels_slow_only_what_crosses():
    w = cm.Workload(16, 2048, (64,) * 26, dense_params=760_000)
    fast = net.Link(300e9)
    flat = cm.iteration_time(w, net.Topology.one_level(fast, 16))
    split = cm.iteration_time(w, net.Topology(8, fast, net.Link(12.5e9)))
    assert split.a2a_forward > flat.a2a_forward and split.allreduce > flat.allreduce
    assert split.compute == flat.compute and split.codec_forward == flat.codec_forward


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda: net.Topology(0, net.Link(1), net.Link(1)), "ranks_per_node"),
        (lambda: net.Topology(4, net.Link(1), net.Link(1)).seconds(net.Collective("ring", 1), 6), "whole number"),
        (lambda: net.Topology(4, net.Link(1), net.Link(1)).seconds(net.Collective("tree", 1), 8), "pattern"),
        (lambda: net.sparse_aggregation(1, 4, "gather"), "aggregation"),
    ],
)
def test_bad_inputs_say_what_is_wrong(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()
