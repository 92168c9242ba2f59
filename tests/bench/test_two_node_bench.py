"""The two-node benchmark's prediction: measured bytes priced on the emulated nodes' links by hand."""

from __future__ import annotations

import pytest

from dlrm.bench import netreport, two_node_bench


def _result(
    fwd: float, bwd: float, dense_params: int, dense_ratio: float, fwd_s: float = 0.0, ms: float = 500.0
) -> netreport.RunResult:
    return netreport.RunResult(
        label="x",
        rate="100mbit",
        repeat=0,
        world_size=4,
        samples_per_iteration=4096,
        iterations_timed=10,
        iteration_ms=ms,
        a2a_ms={"forward": 1e3 * fwd_s, "backward": 0.0},
        a2a_bytes={"forward": fwd, "backward": bwd},
        codec_ms={"forward": 0.0, "backward": 0.0},
        other_a2a_ms=0.0,
        dense_params=dense_params,
        embedding_dims=[64] * 26,
        auc=0.5,
        logloss=0.7,
        forward_ratio=1.0,
        backward_ratio=1.0,
        max_abs_error_seen=None,
        trainer_samples_per_s=None,
        dense_ratio=dense_ratio,
    )


def test_the_emulated_nodes_price_what_crosses_each_veth_by_hand():
    # 2 nodes x 2 ranks, veth 100 Mbit/s = 12.5 MB/s per direction, 1 MB (2^20 B) burst.
    # forward 3 MB per rank: 2 MB of it to the other node, 2 ranks per veth: 4 MB on the link;
    # backward 1.5 MB: 2 MB; input 0.3 MB: 0.4 MB; dense: 1e6 fp32 values, ring all-reduce
    # 2 x 3/4 x 4 MB = 6 MB per rank, ratio 2: 3 MB, one crossing hop per node: 3 MB.
    # Every collective follows one larger than the bucket (the dense one precedes the next
    # forward): no burst, every byte at the rate. The forward's 0.1 s of unthrottled CPU work
    # overlaps its wire time; the input dist (0.032 s) hides in the 0.5 s unthrottled iteration.
    topo = two_node_bench.two_node_topology("100mbit", "1mb", 2)
    # the throttled run's own time (1.5 s) plays no part: the unthrottled one (0.5 s) is the base
    r, base = _result(3e6, 1.5e6, 1_000_000, 2.0, ms=1500.0), _result(3e6, 1.5e6, 1_000_000, 2.0, fwd_s=0.1)
    expected = (4e6 / 12.5e6 - 0.1) + 2e6 / 12.5e6 + 3e6 / 12.5e6
    assert two_node_bench.added_seconds(r, base, 0.3e6, topo) == pytest.approx(expected)
    # what crosses each veth: 4 + 2 + 0.4 MB of all-to-alls, the ring's 3 MB
    assert two_node_bench.node_bytes(r, 0.3e6, topo) == pytest.approx(9.4e6)
    # a backward of 0.75 MB on the link fits in the bucket: the link idles after it, so the dense
    # all-reduce passes its first 2^20 bytes at once; an input dist of 8 MB on the link (6 MB
    # per rank) outlasts the 0.5 s iteration it runs beside, by what it takes beyond it
    small = _result(3e6, 0.5625e6, 1_000_000, 2.0)
    burst = 2**20
    expected = (4e6 / 12.5e6 - 0.1) + 0.75e6 / 12.5e6 + (3e6 - burst) / 12.5e6 + ((8e6 - burst) / 12.5e6 - 0.5)
    assert two_node_bench.added_seconds(small, base, 6e6, topo) == pytest.approx(expected)
    # a backward of exactly the bucket (2^20 bytes on the link) still leaves it idle after; a forward
    # whose unthrottled CPU work (1 s) outlasts its wire time adds nothing
    edge = _result(3e6, 2**20 * 3 / 4, 1_000_000, 2.0)
    slow_cpu = _result(3e6, 1.5e6, 1_000_000, 2.0, fwd_s=1.0)
    expected = 0.0 + 2**20 / 12.5e6 + (3e6 - burst) / 12.5e6
    assert two_node_bench.added_seconds(edge, slow_cpu, 0.3e6, topo) == pytest.approx(expected)
    # unthrottled, nothing is added: the unthrottled run is the calibration
    unthrottled = two_node_bench.two_node_topology("unlimited", "1mb", 2)
    assert two_node_bench.added_seconds(r, base, 0.3e6, unthrottled) == 0.0


def test_the_table_names_each_rate_and_config():
    row = {
        "config": "lossy+dct",
        "rate": "1gbit",
        "ms": 250.0,
        "samples_per_s": 16384.0,
        "unthrottled_ms": 240.0,
        "bytes_per_rank": 120e3,
        "inter_node_bytes_per_iteration": 150e3,
        "predicted_inter_node_bytes": 140e3,
        "predicted_ms": 260.0,
        "error": 0.04,
        "load_before": 3.2,
    }
    text = two_node_bench.markdown([row])
    assert "| 1gbit | lossy+dct | 250 | 16,384 | 240 | 120 | 150 (140) | 260 (+4.0%) | 3.2 |" in text
