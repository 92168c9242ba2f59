"""The network of a job: links, the bytes each collective sends, and its seconds on one level or two.

Pure arithmetic (no torch, TorchRec or trainer import), like :mod:`dlrm.performance.cost_model`,
which prices an iteration on it. Seconds, bytes and bytes/s throughout.

A :class:`Link` is the bandwidth a rank gets and a per-collective latency: a cluster NIC per rank
(``Link(shared=False)``), or one medium that every rank's traffic crosses, like the emulated
loopback of ``scripts/bench_network.sh`` (``Link(shared=True)``: the bytes of all ``N`` ranks queue
on it; its token-bucket shaper also lets a burst through at once at the start of each collective,
``Link.burst_bytes``).

A :class:`Topology` groups the ranks in nodes: a fast link inside a node, a slower one across. A
collective is priced on the links it crosses, by its pattern:

``pairwise`` (an all-to-all: the pooled embeddings, their gradients, the input dist, the first
phase of DCT's reduce-scatter): a rank's bytes go evenly to its ``W-1`` peers, ``g-1`` of them in
its node and ``W-g`` in other nodes; both parts travel at once, so the slower one sets the time::

    t = max(intra.seconds(S (g-1)/(W-1), g), inter.seconds(S (W-g)/(W-1), g))

``ring`` (gloo's all-reduce and all-gather, ranks in order, nodes contiguous): every rank sends
``S`` to its neighbour; in each node ``g-1`` ranks send inside it and one across, and every step
waits for the slowest hop::

    t = max(intra.seconds(S, g-1), inter.seconds(S, 1))

``hierarchical`` (an all-reduce as NCCL's and Horovod's two-level ones: reduce-scatter inside the
node, the node's ``1/g`` shards all-reduced across the ``n = W/g`` nodes by all ``g`` ranks at
once, all-gather inside the node), for ``V`` bytes of values (not bytes sent)::

    t = 2 intra.seconds(V (g-1)/g, g) + inter.seconds(2 (n-1)/n V/g, g)

A level's ``Link.shared`` says whether its medium is shared by the node's ranks (the inter-node
NIC of a node, or the veth pair of the emulated nodes) or each rank has its own (a NIC per GPU).
With every rank in one node (``W <= g``) each pattern is ``link.seconds(S, W)`` on the intra-node
link: one node (:meth:`Topology.one_level`) is the one-level network.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

INF = math.inf


def positive(name: str, value: float, allow_inf: bool = False) -> float:
    """``value`` as a float, or a ValueError naming ``name`` if it is not > 0 (and finite)."""
    v = float(value)
    if not v > 0 or (v == INF and not allow_inf):
        raise ValueError(f"{name} must be a positive{'' if allow_inf else ' finite'} number, got {value!r}")
    return v


@dataclass(frozen=True)
class Link:
    """A network link: bandwidth, per-collective latency, and whether all ranks share it."""

    bytes_per_s: float
    latency_s: float = 0.0
    shared: bool = False  # True: one medium carries every rank's bytes (the emulated loopback)
    # A token-bucket shaper (tc tbf) lets this many bytes through at once after an idle spell:
    # each collective that follows compute starts with a full bucket. 0 for a plain link.
    burst_bytes: float = 0.0

    def __post_init__(self) -> None:
        positive("Link.bytes_per_s", self.bytes_per_s, allow_inf=True)
        if not self.latency_s >= 0 or not self.burst_bytes >= 0:
            raise ValueError(
                f"Link.latency_s and burst_bytes must be >= 0, got {self.latency_s!r}, {self.burst_bytes!r}"
            )

    def per_rank_bytes_per_s(self, ranks: int) -> float:
        """The bandwidth one rank sees while all ``ranks`` send at once."""
        return self.bytes_per_s / ranks if self.shared else self.bytes_per_s

    def seconds(self, bytes_per_rank: float, ranks: int) -> float:
        """Time of a collective in which each of ``ranks`` ranks sends ``bytes_per_rank``."""
        if bytes_per_rank <= 0:
            return 0.0
        on_link = bytes_per_rank * ranks if self.shared else bytes_per_rank
        return self.latency_s + max(0.0, on_link - self.burst_bytes) / self.bytes_per_s


def ring_allreduce_bytes(numel: float, world_size: int, bytes_per_value: float = 4.0) -> float:
    """What one rank sends in a ring all-reduce of ``numel`` values (DDP's and gloo's algorithm: a
    reduce-scatter and an all-gather, each ``N-1`` steps of ``1/N`` of the values). The one formula
    of the project: the dense hooks' counters, the wire meter and the traffic model use it."""
    return 2 * (world_size - 1) / world_size * bytes_per_value * numel


def sparse_aggregation_bytes(body: float, world_size: int, aggregation: str, header: float = 0.0) -> float:
    """What one rank sends to sum every rank's sparse selection (DCT's) of ``body`` bytes of
    positions and values, each payload with a ``header`` and behind an 8-byte size word.
    ``allgather``: its whole payload to every other rank. ``reduce_scatter`` (SparCML's split
    all-gather): the 1/W of it in each other rank's segment, then its own segment's summed top
    entries (again ~1/W of a body) to every other rank: ~2 (W-1)/W bodies instead of (W-1), but
    twice the headers, which decide on small buckets."""
    if aggregation == "allgather":
        return (world_size - 1) * (8 + header + body)
    if aggregation == "reduce_scatter":
        return 2 * (world_size - 1) * (8 + header + body / world_size)
    raise ValueError(f"aggregation must be allgather or reduce_scatter, got {aggregation!r}")


def cheaper_aggregation(body: float, world_size: int, header: float = 0.0) -> str:
    """The aggregation of :func:`sparse_aggregation_bytes` that sends fewer bytes per rank (the
    all-gather on ties: one collective fewer; at W = 2 it never sends more)."""
    both = {a: sparse_aggregation_bytes(body, world_size, a, header) for a in ("allgather", "reduce_scatter")}
    return "reduce_scatter" if both["reduce_scatter"] < both["allgather"] else "allgather"


PATTERNS = ("pairwise", "ring", "hierarchical")


class Collective(NamedTuple):
    """One collective of an iteration: how it moves bytes and how many. ``bytes_per_rank`` is what
    one rank sends for ``pairwise`` and ``ring`` (e.g. :func:`ring_allreduce_bytes`), and the
    bytes of the values to sum for ``hierarchical``."""

    pattern: str
    bytes_per_rank: float


@dataclass(frozen=True)
class Topology:
    """``ranks_per_node`` ranks per node, joined by ``intra``; nodes joined by ``inter``."""

    ranks_per_node: int
    intra: Link
    inter: Link

    def __post_init__(self) -> None:
        if int(self.ranks_per_node) < 1:
            raise ValueError(f"Topology.ranks_per_node must be >= 1, got {self.ranks_per_node!r}")

    @classmethod
    def one_level(cls, link: Link, ranks: int) -> Topology:
        """Every rank in one node on ``link``: the one-level network."""
        return cls(max(int(ranks), 1), link, link)

    def nodes(self, world: int) -> int:
        """How many nodes ``world`` ranks fill; a world that does not fill whole nodes is an error."""
        g = self.ranks_per_node
        if world <= g:
            return 1
        if world % g:
            raise ValueError(f"world size {world} is not a whole number of nodes of {g} ranks")
        return world // g

    def crossing(self, c: Collective, world: int) -> tuple[float, float]:
        """(intra-node, inter-node) bytes one rank sends in ``c`` (for ``ring``, the rank of a node
        that crosses sends all of its bytes across, the others inside)."""
        g, s = self.ranks_per_node, float(c.bytes_per_rank)
        n = self.nodes(world)
        _check(c)
        if n == 1:
            v = ring_allreduce_bytes(s, world, 1.0) if c.pattern == "hierarchical" else s
            return v, 0.0
        if c.pattern == "pairwise":
            return s * (g - 1) / (world - 1), s * (world - g) / (world - 1)
        if c.pattern == "ring":  # averaged over the node's ranks: one of g crosses
            return s * (g - 1) / g, s / g
        return 2 * s * (g - 1) / g, ring_allreduce_bytes(s / g, n, 1.0)

    def seconds(self, c: Collective, world: int) -> float:
        """Time of ``c`` on ``world`` ranks: each part on the link it crosses (module docstring)."""
        _check(c)
        g, s = self.ranks_per_node, float(c.bytes_per_rank)
        if s <= 0:
            return 0.0
        if self.nodes(world) == 1:
            sent = ring_allreduce_bytes(s, world, 1.0) if c.pattern == "hierarchical" else s
            return self.intra.seconds(sent, world)
        if c.pattern == "pairwise":
            intra, inter = self.crossing(c, world)
            return max(self.intra.seconds(intra, g), self.inter.seconds(inter, g))
        if c.pattern == "ring":
            return max(self.intra.seconds(s, g - 1) if g > 1 else 0.0, self.inter.seconds(s, 1))
        n = self.nodes(world)
        inside = self.intra.seconds(s * (g - 1) / g, g) if g > 1 else 0.0
        return 2 * inside + self.inter.seconds(ring_allreduce_bytes(s / g, n, 1.0), g)


def _check(c: Collective) -> None:
    if c.pattern not in PATTERNS:
        raise ValueError(f"collective pattern must be one of {PATTERNS}, got {c.pattern!r}")


def sparse_aggregation(body: float, world: int, aggregation: str, header: float = 0.0) -> tuple[Collective, ...]:
    """The collectives of :func:`sparse_aggregation_bytes` (DCT's sum of
    sparse payloads): ``allgather`` is one ring all-gather of every rank's payload; ``reduce_scatter``
    an all-to-all of the segments, then a ring all-gather of each owner's summed segment."""
    payload = 8 + header
    if aggregation == "allgather":
        return (Collective("ring", (world - 1) * (payload + body)),)
    if aggregation == "reduce_scatter":
        part = (world - 1) * (payload + body / world)
        return Collective("pairwise", part), Collective("ring", part)
    raise ValueError(f"aggregation must be allgather or reduce_scatter, got {aggregation!r}")
