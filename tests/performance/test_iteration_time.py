"""One ``iteration_time`` for one node and for many: on a single link it is the two-level model with
one node, and gives what the single-node builder it replaced gave (its figures recorded below, and
an independent hand computation of the one-level formulas)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrm.performance import cost_model as cm
from dlrm.performance import network as net

FWD, BWD, DENSE = cm.CodecCost(10.0, 3e9, 5e9), cm.CodecCost(7.5, 2e9, 4e9), cm.CodecCost(4.0, 4e9, 8e9)
LOSSY = cm.CodecCost(37.6, 332e9, 513e9)
TERABYTE_8 = cm.Workload(8, 1024, (64,) * 26, dense_params=700_000, compute_s=0.05)

# The figures of the single-node builder ``compression.cost_model.iteration_time`` at 89420d5 (the
# commit before the builders merged), as it printed them; every other component was 0.0.
OLD_SINGLE_NODE = [
    (
        TERABYTE_8,
        net.Link(1e8),
        (FWD, cm.NO_CODEC, DENSE),
        {
            "compute": 0.05,
            "a2a_forward": 0.005963776,
            "a2a_backward": 0.05963776,
            "allreduce": 0.01225,
            "input_dist": 0.00279552,
            "codec_forward": 0.003180680533333333,
            "codec_dense": 0.00105,
        },
    ),
    (
        # by hand: raw = 7/8 x 1024 x 26 x 64 x 4 = 5,963,776 B; forward at ratio 10 from 8 ranks on
        # one shared 100 MB/s medium: 8 x 596,377.6 B / 1e8 + 100 us latency = 47.810208 ms
        TERABYTE_8,
        net.Link(1e8, latency_s=1e-4, shared=True),
        (FWD, BWD),
        {
            "compute": 0.05,
            "a2a_forward": 0.047810208,
            "a2a_backward": 0.06371361066666667,
            "allreduce": 0.3921,
            "input_dist": 0.02246416,
            "codec_forward": 0.003180680533333333,
            "codec_backward": 0.0044728319999999995,
        },
    ),
    (
        # a tbf shaper's 1 MiB burst: the dense all-reduce at ratio 37.6 fits in it and costs nothing
        TERABYTE_8,
        net.Link(12.5e6, shared=True, burst_bytes=2**20),
        (LOSSY, LOSSY, LOSSY),
        {
            "compute": 0.05,
            "a2a_forward": 0.017625000851063822,
            "a2a_backward": 0.017625000851063822,
            "input_dist": 0.0950272,
            "codec_forward": 2.9588475069870123e-05,
            "codec_backward": 2.9588475069870123e-05,
            "codec_dense": 1.3891824608375021e-05,
        },
    ),
    (
        cm.Workload(3, 7, (8,) * 5, dense_params=50),
        net.Link(1e8, latency_s=1e-4, shared=True),
        (FWD, cm.NO_CODEC, DENSE),
        {
            "a2a_forward": 0.00010224000000000001,
            "a2a_backward": 0.0001224,
            "allreduce": 0.000102,
            "input_dist": 0.0001084,
            "codec_forward": 3.9822222222222215e-07,
            "codec_dense": 7.5e-08,
        },
    ),
    (
        cm.Workload(4, 100, (16, 32, 64), dense_params=1000, compute_s=0.01),
        net.Link(1e8),
        (FWD, BWD),
        {
            "compute": 0.01,
            "a2a_forward": 3.36e-05,
            "a2a_backward": 4.48e-05,
            "allreduce": 6e-05,
            "input_dist": 2.7e-05,
            "codec_forward": 1.7919999999999998e-05,
            "codec_backward": 2.5199999999999996e-05,
        },
    ),
    (
        cm.Workload(2, 2048, (64,) * 26, dense_params=762_177, compute_s=1.5e-3),
        net.Link(math.inf),
        (FWD, BWD),
        {"compute": 1.5e-3, "codec_forward": 0.0036350634666666667, "codec_backward": 0.005111808000000001},
    ),
    (cm.Workload(1, 64, (8,)), net.Link(1e8, latency_s=1e-4, shared=True), (FWD, cm.NO_CODEC, DENSE), {}),
]


@pytest.mark.parametrize("w,link,codecs,figures", OLD_SINGLE_NODE)
def test_on_one_link_it_gives_the_old_single_node_builders_figures(w, link, codecs, figures):
    expected = {f: figures.get(f, 0.0) for f in cm.Breakdown.__dataclass_fields__}
    assert cm.iteration_time(w, link, *codecs).as_dict() == pytest.approx(expected, rel=1e-15, abs=0.0)
    assert cm.iteration_time(w, net.Topology.one_level(link, w.ranks), *codecs) == cm.iteration_time(w, link, *codecs)


def _by_hand(w: cm.Workload, link: net.Link, fwd: cm.CodecCost, bwd: cm.CodecCost, dense: cm.CodecCost) -> dict:
    """The one-level model written out from its formulas, using none of the model's own code."""
    n = w.ranks

    def seconds(sent: float) -> float:  # one collective in which every rank sends ``sent`` bytes
        on_link = sent * n if link.shared else sent
        return 0.0 if sent <= 0 else link.latency_s + max(0.0, on_link - link.burst_bytes) / link.bytes_per_s

    raw = (n - 1) / n * w.batch_per_rank * sum(w.dims) * 4
    grads = w.dense_params * 4
    return {
        "compute": w.compute_s,
        "a2a_forward": seconds(raw / fwd.ratio),
        "a2a_backward": seconds(raw / bwd.ratio),
        "allreduce": seconds(2 * (n - 1) / n * grads / dense.ratio),
        "input_dist": seconds((n - 1) / n * w.batch_per_rank * len(w.dims) * 12),
        "codec_forward": raw / fwd.encode_bytes_per_s + raw / fwd.decode_bytes_per_s,
        "codec_backward": raw / bwd.encode_bytes_per_s + raw / bwd.decode_bytes_per_s,
        "codec_dense": grads / dense.encode_bytes_per_s + grads / dense.decode_bytes_per_s,
        "codec_input": 0.0,
        "compute_overlapped": 0.0,
    }


workloads = st.builds(
    cm.Workload,
    ranks=st.integers(1, 16),
    batch_per_rank=st.integers(1, 4096),
    dims=st.lists(st.sampled_from([8, 16, 64, 128]), min_size=1, max_size=30).map(tuple),
    dense_params=st.integers(0, 10**6),
    compute_s=st.floats(0, 1),
)
codecs = st.builds(cm.CodecCost, st.floats(1, 300), st.floats(1e8, 1e12), st.floats(1e8, 1e12))


@settings(max_examples=100, deadline=None)
@given(
    w=workloads,
    shared=st.booleans(),
    gbps=st.floats(0.01, 100),
    latency=st.floats(0, 1e-3),
    burst=st.sampled_from([0.0, 2.0**20]),
    fwd=codecs,
    bwd=codecs,
    dense=codecs,
)
def test_one_node_is_the_one_level_formulas_worked_by_hand(w, shared, gbps, latency, burst, fwd, bwd, dense):
    link = net.Link(gbps * 1e9 / 8, latency_s=latency, shared=shared, burst_bytes=burst)
    hand = _by_hand(w, link, fwd, bwd, dense)
    # one node of exactly W ranks (a bare link), or a bigger node whose other link is never used
    for network in (link, net.Topology(w.ranks + 3, link, net.Link(1.0))):
        got = cm.iteration_time(w, network, fwd, bwd, dense)
        assert got.as_dict() == pytest.approx(hand, rel=1e-12, abs=1e-15)
        # nothing overlaps: the total is the sum of the parts
        assert got.total == pytest.approx(sum(hand.values()), rel=1e-12)
