"""compression=auto / dense_comm=auto: the timeline model and greedy choice, the per-block codec
that applies it within the policy's bounds, and the whole cycle on real gloo ranks."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from trainer_runs import losses, train

import dlrm_compression as compression
from dlrm.strategy.controller import parse_strategy_cfg
from dlrm_compression.cost_model import Link
from dlrm_compression.strategy import Option, Timeline, Unit, choose, simulate

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
    for bad in (1.0, -0.1, True, "3%"):
        with pytest.raises(ValueError, match=r"compression\.strategy\.min_gain"):
            parse_strategy_cfg({"min_gain": bad}, None)
    assert parse_strategy_cfg({"min_gain": 0}, None).min_gain == 0.0


def test_the_per_block_codec_never_lets_a_cast_exceed_a_block_bound():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=g) * 0.1
    codec = compression.get_codec("per_block")
    # fp16's worst case on these blocks is ~2^-11 x 0.4 ~ 2e-4: fine for 1e-3, not for 1e-6
    bounds = [1e-3, 1e-6, 1e-3, 0.05]
    choice = ["fp16", "fp16", "int8", "none"]
    payload = codec.encode(x, bounds, blocks=[8] * 4, choice=choice)
    assert codec.groups(payload) == ["fp16", "lossy", "lossy", "none"]  # int8 needs range/510 <= 1e-3 too
    y = codec.decode(payload)
    err = (y - x).abs().view(256, 4, 8).amax(dim=(0, 2))
    assert all(e <= b for e, b in zip(err.tolist(), bounds, strict=True))
    assert torch.equal(y[:, 24:], x[:, 24:])  # none is exact
    bad = payload.clone()
    bad[len(bad) // 2] ^= 0x01
    with pytest.raises(compression.PayloadError):
        codec.decode(bad)


def test_one_codec_for_every_block_travels_as_that_codecs_own_payload():
    """Once a strategy is chosen most chunks use one codec: no second header, copy or checksum."""
    x = torch.randn(128, 24, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, 20, (128, 3), generator=torch.Generator().manual_seed(2))
    codec = compression.get_codec("per_block")
    for name in ("none", "fp16"):
        alone = compression.get_codec(name).encode(x, [0.01] * 3, ids, blocks=[8] * 3)
        payload = codec.encode(x, [0.01] * 3, ids, blocks=[8] * 3, choice=[name] * 3)
        assert torch.equal(payload, alone)
        assert codec.groups(payload) == [name] * 3
        assert torch.equal(codec.decode(payload, ids), compression.get_codec(name).decode(alone, ids))
        bad = payload.clone()
        bad[len(bad) // 2] ^= 0x01
        with pytest.raises(compression.PayloadError, match="checksum"):
            codec.decode(bad, ids)


def test_the_per_block_device_path_decides_the_fallback_on_the_device_and_decodes_from_one_read():
    """compression=auto as on a GPU: groups fixed by the choice, each block's option (its choice,
    or the fallback where that could exceed its bound) decided on the device; the same values as
    the host path, no host sync to encode or decode once the head is read, the check held."""
    from dlrm.bench.host_syncs import counted_reads
    from dlrm_compression import format as fmt
    from dlrm_compression.base import CodecContext
    from dlrm_compression.host_syncs import HostSyncCounter

    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 30, (96, 5), generator=g)
    table = torch.randn(30, 40, generator=g) * 0.1
    x = torch.cat([table[ids[:, b], 8 * b : 8 * b + 8] for b in range(5)], 1)  # rows equal per id
    options = {"options": ["none", "fp16", "bf16", "lossy/fixed"], "fallback": "lossy/fixed"}
    # the host path (the CPU's shortcuts), and the device's code run on CPU tensors
    on_host = compression.get_codec("per_block", backend="host", **options)
    codec = compression.get_codec("per_block", backend="device", **options)
    # fp16 holds 1e-3 on these blocks (~2^-11 x 0.4) but not 1e-6; bf16 (~2^-8 x 0.4) not 1e-3
    bounds, widths = [1e-3, 1e-6, 1e-3, 0.0, 1e-3], [8] * 5
    choice = ["fp16", "fp16", "bf16", "none", "lossy/fixed"]
    host = on_host.encode(x, bounds, ids, blocks=widths, choice=choice)
    want = on_host.decode(host, ids)
    assert on_host.groups(host) == ["fp16", "lossy", "lossy", "none", "lossy"]
    enc, dec = HostSyncCounter(), HostSyncCounter()
    eb = torch.tensor(bounds, dtype=torch.float64)
    with counted_reads(enc), enc:
        late = codec.encode_deferred(x, eb, ids, blocks=widths, choice=choice)
    assert isinstance(late, fmt.Deferred)
    [payload] = fmt.settle([late])
    assert codec.groups(payload) == on_host.groups(host)

    def read(p):
        extra, state = codec.prepare_decode(p, ids, CodecContext(choice=choice)) or (None, None)
        [head] = fmt.read_heads([p], [extra], [codec.head_size(len(widths))])
        head.state = state
        return head

    head = read(payload)
    with counted_reads(dec), dec:
        got = codec.decode(payload, ids, head=head)
    assert torch.equal(got, want) and torch.equal(codec.decode(payload, ids), want)  # read or not
    assert enc.total == dec.total == 0, (enc.by_op, dec.by_op)
    bad = payload.clone()
    bad[bad.numel() - 9] ^= 0x04  # in the last group's payload
    with pytest.raises(compression.PayloadError, match="checksum"):
        codec.decode(bad, ids, head=read(bad))


# --------------------------------------------------------------------------- on real ranks


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


AUTO = [
    "compression=auto",
    "dense_comm=auto",
    "compression.strategy.calibrate_iterations=2",
    "compression.strategy.measure_iterations=2",
    "max_iterations=14",
    "loss_log=true",
    "policy=fixed",
]


def test_auto_decides_for_every_rank_settles_once_and_a_replay_reproduces_the_losses(tmp_path, cache):
    first, replay = tmp_path / "auto", tmp_path / "replay"
    train(first, cache, AUTO)
    saved = json.loads((first / "strategy.json").read_text())["plans"]
    assert saved and saved[0]["calibrated_from"] == 0 and saved[0]["from_iteration"] == 4
    # the first plan was timed on the run's first iterations: the next 2 re-make it, drift or not
    assert saved[0]["settled"] is False and saved[0]["timed_iterations"] == [3, 4]
    assert saved[1]["settled"] is True and saved[1]["from_iteration"] == 6 and saved[1]["timed_iterations"] == [5, 6]
    assert saved[1]["units"] == saved[0]["units"]  # the codecs are not measured again
    plan = [p for p in saved if p["choice"] is not None][-1]
    units_of = {u["name"]: u for u in plan["units"]}
    assert set(plan["choice"]) == set(units_of) and "dense" in units_of
    assert {n.split("/")[0] for n in plan["choice"] if n not in ("dense", "input")} == {"forward", "backward"}
    assert "input" in units_of  # compression.input: auto (auto.yaml's default)
    # every rank applied the same plan (rank 0 decides and broadcasts)
    applied = [
        re.findall(r"strategy from iteration (\d+): (.*)", (first / f"train_rank{r}.log").read_text()) for r in (0, 1)
    ]
    assert applied[0] and applied[0] == applied[1]
    metrics = json.loads((first / "metrics.json").read_text())
    assert metrics["strategy"] and metrics["predicted_iteration_ms"] > 0
    # the choice never loosened a bound: every sampled error (of the payloads as sent) within it
    assert metrics["max_abs_error_seen"] > 0  # something lossy travelled (the fallback, at least)
    from run_artifacts import scalars

    over = {t: v for t, v in scalars(first, "comm/").items() if t.endswith("/max_error_over_bound")}
    assert over and all(v <= 1.0 for series in over.values() for v in series.values())
    # the saved strategy replayed from its file: the same codecs at the same iterations
    train(replay, cache, [*AUTO, f"compression.strategy_file={first / 'strategy.json'}"])
    assert losses(replay) == losses(first)
    assert not (replay / "strategy.json").exists() or json.loads((replay / "strategy.json").read_text())["plans"] == []


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
def test_a_plan_of_none_everywhere_costs_and_computes_what_compression_none_does(tmp_path, cache, sharding):
    """Every table at ``none`` travels as TorchRec's own all-to-all: the same losses as stock
    TorchRec (compression=none), and the same bytes on the wire (ratio 1, no framing)."""
    common = ["max_iterations=6", "loss_log=true", f"sharding={sharding}", "policy=fixed"]
    train(tmp_path / "none", cache, [*common, "compression=none"])
    features = [f"cat_{i}" for i in range(26)]
    plan = {
        "calibrated_from": 0,
        "from_iteration": 0,
        "choice": {f"{d}/{f}": "none" for d in ("forward", "backward") for f in features},
    }
    (tmp_path / "none.json").write_text(json.dumps({"plans": [plan]}))
    train(
        tmp_path / "auto", cache, [*common, "compression=auto", f"compression.strategy_file={tmp_path / 'none.json'}"]
    )
    assert losses(tmp_path / "auto") == losses(tmp_path / "none")
    metrics = json.loads((tmp_path / "auto" / "metrics.json").read_text())
    assert metrics["forward_ratio"] == 1.0 and metrics["backward_ratio"] == 1.0


def test_calibrated_options_choose_by_the_link(tmp_path, cache):
    # the units as a real run calibrated them, priced on a slow and on an infinite link
    run = tmp_path / "auto"
    train(run, cache, [*AUTO, "max_iterations=6"])
    plan = json.loads((run / "strategy.json").read_text())["plans"][0]
    real = [
        Unit(u["name"], u["name"].split("/")[0], u["raw_bytes"], tuple(Option(**o) for o in u["options"]))
        for u in plan["units"]
    ]
    exact = {u.name: "none" for u in real}
    slow = choose(real, Timeline(Link(1e5), ranks=2, between=plan["compute_ms"] / 1e3), start=exact)
    # (the input's raw bytes may still fit in the link's idle time: tested on its own)
    big = [u for u in real if u.raw_bytes > 4096 and u.stage != "input"]
    assert big and all(slow[u.name] in ("lossy/zstd", "lossy/fixed", "dct") for u in big)
    free = choose(real, Timeline(Link(math.inf), ranks=2), start=exact)
    # with the link free, only options cheaper to run than copying the bytes ("none") can win
    for u in real:
        chosen = u.option(free[u.name])
        assert chosen.encode_s + chosen.decode_s <= u.option("none").encode_s + u.option("none").decode_s


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


def test_the_link_fit_finds_latency_or_a_free_burst():
    from dlrm.strategy.controller import fit_link

    # 1 ms + bytes / 10 MB/s, by hand at 0.25, 1 and 4 MB
    link = fit_link([(0.25e6, 0.026), (1e6, 0.101), (4e6, 0.401)])
    assert link.bytes_per_s == pytest.approx(10e6) and link.latency_s == pytest.approx(0.001)
    # a shaper that lets 1 MB through at once: 0 s, 0 s, then (4 - 1) MB at 10 MB/s
    shaped = fit_link([(0.25e6, 0.0), (1e6, 0.0), (4e6, 0.3)])
    assert shaped.bytes_per_s == pytest.approx(10e6) and shaped.burst_bytes == pytest.approx(1e6)
    assert shaped.seconds(0.5e6, 2) == 0.0 and shaped.seconds(4e6, 2) == pytest.approx(0.3)


def test_the_cost_model_without_overlap_is_the_timeline_with_no_compute_after_the_backward():
    from dlrm_compression.cost_model import CodecCost, Workload, iteration_time

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


def test_while_auto_calibrates_the_wire_carries_the_fixed_defaults_and_the_plan_times_steady_iterations(
    tmp_path, cache
):
    """While auto calibrates and measures, its options are tried on the side: what travels is the
    all-to-alls' bounded fallback (lossy) and dense_comm.fallback (dct), so each of those
    iterations sends the bytes that a `compression=lossy dense_comm=dct` run of the same seed
    sends; and the plan's compute comes from the measuring iterations only."""
    common = ["max_iterations=7", "loss_log=true", "policy=fixed"]
    auto = [
        "compression=auto",
        "dense_comm=auto",
        "compression.strategy.calibrate_iterations=3",
        "compression.strategy.measure_iterations=2",
    ]
    train(tmp_path / "auto", cache, [*common, *auto])
    train(tmp_path / "fixed", cache, [*common, "compression=lossy", "dense_comm=dct"])
    from run_artifacts import scalars

    plan = json.loads((tmp_path / "auto" / "strategy.json").read_text())["plans"][0]
    assert plan["calibrated_from"] == 0 and plan["from_iteration"] == 5
    assert plan["timed_iterations"] == [4, 5]  # after the 3 calibrating iterations, none of them
    got, ref = scalars(tmp_path / "auto", "comm/"), scalars(tmp_path / "fixed", "comm/")
    for path in ("forward", "backward", "dense"):
        a, b = got[f"comm/{path}/wire_bytes"], ref[f"comm/{path}/wire_bytes"]
        for it in range(1, plan["from_iteration"] + 1):
            assert a[it] == pytest.approx(b[it], rel=0.01), (path, it, a[it], b[it])


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
    from dlrm_compression.cost_model import CodecCost, Workload
    from dlrm_compression.topology import Topology, iteration_time

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
    from dlrm_compression.topology import Topology

    one = Timeline(fast, 8, between=0.01, topology=Topology.one_level(fast, 8))
    two = Timeline(fast, 8, between=0.01, topology=Topology(4, fast, Link(100 * MB, shared=True)))
    assert choose(units, one, start=exact) == exact
    assert simulate(units, exact, one).total == simulate(units, exact, Timeline(fast, 8, between=0.01)).total
    assert choose(units, two, start=exact) == {"forward/t": "lossy", "backward/t": "lossy", "dense": "dct"}


def test_one_node_needs_no_topology():
    from dlrm.process.env import DistEnv
    from dlrm.strategy.controller import calibrate_topology

    env = DistEnv(rank=0, world_size=4, local_rank=0, local_world_size=4, device=torch.device("cpu"), backend="gloo")
    assert calibrate_topology(env) is None  # no collective: one node keeps the one-level link
