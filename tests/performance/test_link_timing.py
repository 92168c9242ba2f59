"""Link timing: the fit of timed all-to-alls finds latency or a shaper's free burst; one node times
no second link."""

from __future__ import annotations

import pytest
import torch


def test_the_link_fit_finds_latency_or_a_free_burst():
    from dlrm.performance.link_timing import fit_link

    # 1 ms + bytes / 10 MB/s, by hand at 0.25, 1 and 4 MB
    link = fit_link([(0.25e6, 0.026), (1e6, 0.101), (4e6, 0.401)])
    assert link.bytes_per_s == pytest.approx(10e6) and link.latency_s == pytest.approx(0.001)
    # a shaper that lets 1 MB through at once: 0 s, 0 s, then (4 - 1) MB at 10 MB/s
    shaped = fit_link([(0.25e6, 0.0), (1e6, 0.0), (4e6, 0.3)])
    assert shaped.bytes_per_s == pytest.approx(10e6) and shaped.burst_bytes == pytest.approx(1e6)
    assert shaped.seconds(0.5e6, 2) == 0.0 and shaped.seconds(4e6, 2) == pytest.approx(0.3)


def test_one_node_needs_no_topology():
    from dlrm.performance.link_timing import calibrate_topology
    from dlrm.process.env import DistEnv

    env = DistEnv(rank=0, world_size=4, local_rank=0, local_world_size=4, device=torch.device("cpu"), backend="gloo")
    assert calibrate_topology(env) is None  # no collective: one node keeps the one-level link
