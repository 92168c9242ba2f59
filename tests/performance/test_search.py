"""The timeline of one iteration and Espresso's greedy choice over it (``compression=auto``'s model):
spans and totals worked by hand, choices by link speed, the margin a plan must clear, the cost of
mixing codecs, the input dist a batch ahead, and the same units priced on two levels."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from dlrm.performance.network import Link
from dlrm.performance.search import Option, Timeline, Unit, choose, simulate

MB = 1e6


def units(raw: float = 1 * MB) -> list[Unit]:
    """Two tables and the dense gradients; the codec options as calibration would measure them."""
    a2a = (Option("none"), Option("fp16", 2.0, 0.0005, 0.0005), Option("lossy/zstd", 40.0, 0.004, 0.002))
    dense = (Option("none"), Option("fp16", 2.0, 0.001, 0.001), Option("dct", 150.0, 0.01, 0.004))
    return [
        Unit("forward/cat_0", "forward", raw, a2a),
        Unit("backward/cat_0", "backward", raw / 2, a2a),
        Unit("dense", "dense", 3 * MB, dense),
    ]


def test_the_timeline_serialises_the_link_and_overlaps_the_dense_all_reduce_with_the_end_of_the_backward():
    # by hand, 1 MB/s link, no latency, nothing compressed: forward 1 s, backward 0.5 s, dense 3 s;
    # compute 0.1 before, 0.2 between, 1.0 after (the dense all-reduce overlaps it: 3 s > 1 s)
    t = Timeline(Link(1 * MB), ranks=2, before=0.1, between=0.2, after=1.0)
    sim = simulate(units(), {"forward/cat_0": "none", "backward/cat_0": "none", "dense": "none"}, t)
    assert sim.spans["forward"] == pytest.approx((0.1, 1.1))
    assert sim.spans["backward"] == pytest.approx((1.3, 1.8))
    assert sim.spans["dense"] == pytest.approx((1.8, 4.8))
    assert sim.total == pytest.approx(4.8)
    # codec time sits on the compute path: fp16 on the forward table encodes 0.5 ms before its
    # all-to-all (now 0.5 s) and decodes 0.5 ms after it
    sim = simulate(units(), {"forward/cat_0": "fp16", "backward/cat_0": "none", "dense": "none"}, t)
    assert sim.spans["forward"] == pytest.approx((0.1005, 0.6005))
    assert sim.total == pytest.approx(0.6005 + 0.0005 + 0.2 + 0.5 + 3.0)


def test_a_slow_link_chooses_the_high_ratio_options_and_an_infinite_one_chooses_none():
    t = Timeline(Link(1 * MB), ranks=2, between=0.05)
    exact = {u.name: "none" for u in units()}
    assert choose(units(), t, start=exact) == {
        "forward/cat_0": "lossy/zstd",
        "backward/cat_0": "lossy/zstd",
        "dense": "dct",
    }
    fast = Timeline(Link(math.inf), ranks=2, between=0.05)
    assert choose(units(), fast, start=exact) == exact
    # in between (100 MB/s): the cast pays where its bytes are many, the entropy coder does not
    mid = Timeline(Link(100 * MB), ranks=2, between=0.05)
    chosen = choose(units(), mid, start=exact)
    assert chosen["dense"] != "none" and chosen["forward/cat_0"] == "fp16"


def test_a_plan_whose_gain_is_inside_the_margin_sends_raw():
    # 100 MB/s, 50 ms of compute: raw is 50 + 10 (forward) + 5 (backward) + 30 (dense) = 95 ms,
    # and the greedy plan well below it: taken at the default margin
    exact = {u.name: "none" for u in units()}
    mid = Timeline(Link(100 * MB), ranks=2, between=0.05)
    greedy = choose(units(), mid, start=exact)
    assert greedy != exact and choose(units(), mid, start=exact, min_gain=0.03) == greedy
    raw, planned = simulate(units(), exact, mid).total, simulate(units(), greedy, mid).total
    gain = 1 - planned / raw
    assert raw == pytest.approx(0.095) and gain > 0.2  # 73.7 ms: fp16 both ways, dct
    # a margin above the plan's own gain keeps the start; just below it, the plan
    assert choose(units(), mid, start=exact, min_gain=gain + 1e-6) == exact
    assert choose(units(), mid, start=exact, min_gain=gain - 1e-6) == greedy


def test_mixing_codecs_within_an_all_to_all_must_pay_for_its_regrouping():
    # two forward tables, 1 MB each on a 100 MB/s link: fp16 saves 5 ms of wire on each for
    # 0.5 + 0.5 ms of codec. Without a regrouping cost the greedy takes it table by table; at
    # 10 ns per raw byte (20 ms for the stage's 2 MB, each way), only a switch of every table pays
    a2a = (Option("none"), Option("fp16", 2.0, 0.0005, 0.0005))
    us = [Unit("forward/a", "forward", 1 * MB, a2a), Unit("forward/b", "forward", 1 * MB, a2a)]
    exact = {u.name: "none" for u in us}
    cheap = Timeline(Link(100 * MB), ranks=2)
    assert choose(us, cheap, start=exact) == {"forward/a": "fp16", "forward/b": "fp16"}
    costly = Timeline(Link(100 * MB), ranks=2, regroup_s_per_byte=1e-8)
    mixed = simulate(us, {"forward/a": "fp16", "forward/b": "none"}, costly).total
    assert mixed == pytest.approx(simulate(us, exact, costly).total - 0.005 + 0.001 + 2 * 0.02)
    # one table alone: 5 ms saved, 41 ms spent; both at once (one codec, no regrouping) pays
    assert choose(us, costly, start=exact) == {"forward/a": "fp16", "forward/b": "fp16"}
    slower = Timeline(Link(100 * MB), ranks=2, regroup_s_per_byte=1e-8)
    b_only = (Option("none"), Option("fp16", 2.0, 0.02, 0.02))  # too slow a codec on table b
    us = [Unit("forward/a", "forward", 1 * MB, a2a), Unit("forward/b", "forward", 1 * MB, b_only)]
    assert choose(us, slower, start=exact) == exact  # a alone would not pay its regrouping


def test_the_cost_model_without_overlap_is_the_timeline_with_no_compute_after_the_backward():
    from dlrm.performance.cost_model import CodecCost, Workload, iteration_time

    w = Workload(ranks=4, batch_per_rank=512, dims=(64,) * 8, dense_params=2_000_000, compute_s=0.03)
    w = replace(w, input_bytes_per_lookup=0)  # the strategy's units leave the input dist out
    link = Link(50 * MB, latency_s=1e-4)
    fwd, bwd, dense = CodecCost(8.0, 400 * MB, 800 * MB), CodecCost(3.0, 900 * MB, 900 * MB), CodecCost(2.0)
    raw = w.a2a_bytes()

    def option(c: CodecCost, raw: float) -> Option:
        return Option("c", c.ratio, raw / c.encode_bytes_per_s, raw / c.decode_bytes_per_s)

    units = [
        Unit("f", "forward", raw, (option(fwd, raw),)),
        Unit("b", "backward", raw, (option(bwd, raw),)),
        Unit("d", "dense", w.allreduce_bytes(), (Option("c", 2.0, 0.0, 0.0),)),
    ]
    serial = Timeline(link, w.ranks, before=w.compute_s)
    modelled = iteration_time(w, link, fwd, bwd, dense)
    assert simulate(units, {"f": "c", "b": "c", "d": "c"}, serial).total == pytest.approx(modelled.total, rel=1e-12)
    assert modelled.allreduce > 0.005  # the dense all-reduce takes real time here
    # moving compute after the backward hides the all-reduce behind it: the total drops by the overlap
    overlapped = Timeline(link, w.ranks, before=w.compute_s - 0.005, after=0.005)
    saved = modelled.total - simulate(units, {"f": "c", "b": "c", "d": "c"}, overlapped).total
    assert saved == pytest.approx(0.005, rel=1e-9)


def test_the_input_all_to_all_is_coded_only_where_its_bytes_wait_on_the_link():
    """The input dist runs a batch ahead, beside the compute: its raw bytes cost only what does not
    fit in the link's idle time, so coding them (10 ms of CPU) pays on a slow link, not a fast one."""
    fwd = Unit("forward/cat_0", "forward", 1 * MB, (Option("none"),))
    ids = Option("ids", 8.0, 0.008, 0.002)
    inp = Unit("input", "input", 0.6 * MB, (Option("none"), ids))
    exact = {"forward/cat_0": "none", "input": "none"}
    coded = {**exact, "input": "ids"}
    totals = {}
    for rate, pays in ((1 * MB, True), (1000 * MB, False)):
        t = Timeline(Link(rate), ranks=2, between=0.05)
        # by hand: the forward all-to-all holds the link 1 MB / rate; the 0.05 s of compute leaves it idle
        a2a, idle = 1 * MB / rate, 0.05
        raw_total = a2a + idle + max(0.6 * MB / rate - idle, 0.0)
        coded_total = a2a + idle + max(0.6 * MB / 8 / rate - idle, 0.0) + 0.010
        assert simulate([fwd, inp], exact, t).total == pytest.approx(raw_total)
        assert simulate([fwd, inp], coded, t).total == pytest.approx(coded_total)
        assert (coded_total < raw_total) == pays
        assert choose([fwd, inp], t, start=exact) == (coded if pays else exact)
        totals[rate] = (raw_total, coded_total)
    # on the slow link 0.55 s of the raw input is exposed, 0.025 s coded (+ 10 ms of codec); on the
    # fast one none of it, and the codec's 10 ms are the difference
    assert totals[1 * MB] == pytest.approx((1.6, 1.085))
    assert totals[1000 * MB] == pytest.approx((0.051, 0.061))


def test_on_two_nodes_the_timeline_is_the_two_level_cost_model():
    from dlrm.performance.cost_model import CodecCost, Workload, iteration_time
    from dlrm.performance.network import Topology

    w = Workload(ranks=8, batch_per_rank=512, dims=(64,) * 8, dense_params=2_000_000, compute_s=0.03)
    w = replace(w, input_bytes_per_lookup=0)  # the strategy's units leave the input dist out
    topo = Topology(4, Link(2000 * MB, latency_s=1e-5), Link(50 * MB, latency_s=1e-4, shared=True))
    fwd, bwd, dense = CodecCost(8.0, 400 * MB, 800 * MB), CodecCost(3.0, 900 * MB, 900 * MB), CodecCost(2.0)
    raw = w.a2a_bytes()
    units = [
        Unit("f", "forward", raw, (Option("c", 8.0, raw / (400 * MB), raw / (800 * MB)),)),
        Unit("b", "backward", raw, (Option("c", 3.0, raw / (900 * MB), raw / (900 * MB)),)),
        Unit("d", "dense", w.allreduce_bytes(), (Option("c", 2.0, 0.0, 0.0),)),
    ]
    serial = Timeline(topo.inter, w.ranks, before=w.compute_s, topology=topo)
    modelled = iteration_time(w, topo, fwd, bwd, dense)
    assert simulate(units, {"f": "c", "b": "c", "d": "c"}, serial).total == pytest.approx(modelled.total, rel=1e-12)
    # by hand: node 0's NIC carries 4 ranks x 4/7 of the forward wire bytes
    fwd_wire = 4 * raw / 8.0 * 4 / 7
    assert modelled.a2a_forward == pytest.approx(1e-4 + fwd_wire / (50 * MB))


def test_a_slow_link_across_nodes_turns_compression_on_where_one_fast_node_would_not():
    """The same units on 8 ranks: all in one node on a fast link, auto sends them raw; 2 nodes of
    4 whose inter-node link is 100x slower, it compresses, because what crosses is priced there."""
    fast = Link(10_000 * MB)
    a2a = (Option("none"), Option("lossy", 40.0, 0.004, 0.004))
    dense = (Option("none"), Option("dct", 300.0, 0.002, 0.002))
    units = [
        Unit("forward/t", "forward", 20 * MB, a2a),
        Unit("backward/t", "backward", 20 * MB, a2a),
        Unit("dense", "dense", 6 * MB, dense),
    ]
    exact = {u.name: "none" for u in units}
    from dlrm.performance.network import Topology

    one = Timeline(fast, 8, between=0.01, topology=Topology.one_level(fast, 8))
    two = Timeline(fast, 8, between=0.01, topology=Topology(4, fast, Link(100 * MB, shared=True)))
    assert choose(units, one, start=exact) == exact
    assert simulate(units, exact, one).total == simulate(units, exact, Timeline(fast, 8, between=0.01)).total
    assert choose(units, two, start=exact) == {"forward/t": "lossy", "backward/t": "lossy", "dense": "dct"}
