"""Link timing: the links a job's ranks see, fitted to timed all-to-alls on its own process groups.

``latency + max(0, bytes - burst) / bandwidth`` per rank, every rank sending at once as in
training (:func:`calibrate_link`, :func:`fit_link`); on several nodes the intra- and inter-node
links apart, on TorchRec's intra- and cross-node groups (:func:`calibrate_topology`). The one
place that times links: ``compression=auto``'s strategy (:mod:`dlrm.strategy.controller`) and
``sharding=comm_aware``'s planner (:mod:`dlrm.placement.comm_aware`) both call it, and price what
they measure with :mod:`dlrm.performance.network`.
"""

from __future__ import annotations

import logging
import math
import statistics
import time

import torch
import torch.distributed as dist
from torchrec.distributed.comm import intra_and_cross_node_pg

from dlrm.process.env import DistEnv, collective_device, device_synchronize

from .network import Link, Topology

log = logging.getLogger(__name__)
LINK_SIZES = (1 << 18, 1 << 20, 1 << 22)  # bytes per peer of the timed all-to-alls


def calibrate_link(
    env: DistEnv,
    sizes: tuple[int, ...] = LINK_SIZES,
    repeats: int = 3,
    group: dist.ProcessGroup | None = None,
    active: bool = True,
) -> Link:
    """``latency + bytes / bandwidth`` fitted to timed all-to-alls of ``sizes`` bytes per peer
    (every rank sends to every other at once, as the training collectives do), on the process
    group's device, which is synchronised before each clock reading. A collective of the world:
    with ``group`` every rank times its own group's all-to-all (all groups at once), and a rank
    with ``active=False`` sends nothing (its group must be idle too) and only waits."""
    ws, device = dist.get_world_size(group), collective_device()
    points = []
    for size in sizes:
        send = torch.zeros(size * ws, dtype=torch.uint8, device=device)
        recv = torch.empty_like(send)
        times = []
        for _ in range(repeats):
            dist.barrier()
            device_synchronize(device)
            t0 = time.perf_counter()
            if active:
                dist.all_to_all_single(recv, send, group=group)
            device_synchronize(device)
            times.append(time.perf_counter() - t0)
        slowest = torch.tensor([statistics.median(times) if active else 0.0], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the collective ends with its slowest rank
        points.append((float(size * (ws - 1)), float(slowest)))  # bytes each rank sends, seconds
    return fit_link(points)


def calibrate_topology(env: DistEnv, sizes: tuple[int, ...] = LINK_SIZES) -> Topology | None:
    """The intra- and inter-node links of a job on several nodes (None on one node), timed on
    TorchRec's intra-node and cross-node groups (``intra_and_cross_node_pg``; table_row_wise
    shards on the same ones): the intra-node link with every node's all-to-all at once, the
    inter-node link with every cross-node group's at once (as an all-to-all crosses), then with
    local rank 0's alone. On a medium the node's ``g`` ranks share (a NIC per node), one alone
    goes up to ``g`` times as fast; on a link per rank, as fast. Nearer ``g`` (more than
    ``sqrt(g)`` times as fast: a single TCP flow through a shaper does not reach its rate, so the
    ratio falls short of ``g``) is ``Link(shared=True)``, carrying all of them. A collective."""
    g, ws = env.local_world_size, env.world_size
    if g >= ws:
        return None
    intra_pg, cross_pg = intra_and_cross_node_pg(collective_device(), dist.get_backend())
    intra = calibrate_link(env, sizes, group=intra_pg) if g > 1 else Link(math.inf)
    inter = calibrate_link(env, sizes, group=cross_pg)
    alone = calibrate_link(env, sizes, group=cross_pg, active=env.rank % g == 0) if g > 1 else inter
    log.info(
        "strategy: links per rank %.3g B/s inside a node, %.3g B/s across with all %d ranks of a node "
        "crossing, %.3g B/s with one",
        intra.bytes_per_s,
        inter.bytes_per_s,
        g,
        alone.bytes_per_s,
    )
    if alone.bytes_per_s > math.sqrt(g) * inter.bytes_per_s:
        inter = Link(inter.bytes_per_s * g, inter.latency_s, shared=True, burst_bytes=inter.burst_bytes * g)
    return Topology(g, intra, inter)


def fit_link(points: list[tuple[float, float]]) -> Link:
    """``latency + max(0, bytes - burst) / bandwidth`` through (bytes per rank, seconds) points:
    the bandwidth from the two largest transfers, then a positive intercept is latency and a
    negative one a burst that passes for free (a token-bucket shaper's, like ``tc tbf``)."""
    (x1, y1), (x2, y2) = sorted(points)[-2:]
    slope = (y2 - y1) / (x2 - x1) if x2 > x1 else 0.0
    if not slope > 0:  # faster than the clock can tell: an infinite link
        return Link(math.inf, latency_s=max(min(y for _, y in points), 0.0))
    intercept = y2 - slope * x2
    return Link(1.0 / slope, latency_s=max(intercept, 0.0), burst_bytes=max(-intercept / slope, 0.0))
