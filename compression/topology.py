"""Two levels of network: ranks grouped in nodes, a fast link inside a node, a slower one across.

Pure arithmetic, like :mod:`compression.cost_model`, whose :class:`~compression.cost_model.Link`
describes each level. A collective is priced on the links it crosses, by its pattern:

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
With every rank in one node (``W <= g``) each pattern is the one-level model's
``link.seconds(S, W)`` on the intra-node link, so :func:`Topology.one_level` reproduces it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .cost_model import NO_CODEC, Breakdown, CodecCost, Link, Workload, ring_allreduce_bytes

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
        """Every rank in one node on ``link``: the one-level model of :mod:`compression.cost_model`."""
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
    """The collectives of :func:`compression.cost_model.sparse_aggregation_bytes` (DCT's sum of
    sparse payloads): ``allgather`` is one ring all-gather of every rank's payload; ``reduce_scatter``
    an all-to-all of the segments, then a ring all-gather of each owner's summed segment."""
    payload = 8 + header
    if aggregation == "allgather":
        return (Collective("ring", (world - 1) * (payload + body)),)
    if aggregation == "reduce_scatter":
        part = (world - 1) * (payload + body / world)
        return Collective("pairwise", part), Collective("ring", part)
    raise ValueError(f"aggregation must be allgather or reduce_scatter, got {aggregation!r}")


def iteration_time(
    w: Workload,
    topo: Topology,
    forward: CodecCost = NO_CODEC,
    backward: CodecCost = NO_CODEC,
    dense: CodecCost = NO_CODEC,
    allreduce: str = "ring",
    dense_collectives: tuple[Collective, ...] | None = None,
    input_ratio: float = 1.0,
) -> Breakdown:
    """:func:`compression.cost_model.iteration_time` on two levels: the all-to-alls (and the input
    dist, its bytes divided by ``input_ratio``) pairwise, the dense all-reduce as ``allreduce``
    (``ring`` or ``hierarchical``) with its bytes divided by ``dense``'s ratio, or, given
    ``dense_collectives`` (e.g. :func:`sparse_aggregation`), those instead."""
    raw, ws = w.a2a_bytes(), w.ranks
    if dense_collectives is None:
        values = w.dense_params * w.value_bytes / dense.ratio
        size = values if allreduce == "hierarchical" else ring_allreduce_bytes(values, ws, 1.0)
        dense_collectives = (Collective(allreduce, size),)
    return Breakdown(
        compute=w.compute_s,
        a2a_forward=topo.seconds(Collective("pairwise", raw / forward.ratio), ws),
        a2a_backward=topo.seconds(Collective("pairwise", raw / backward.ratio), ws),
        allreduce=sum(topo.seconds(c, ws) for c in dense_collectives),
        input_dist=topo.seconds(Collective("pairwise", w.input_dist_bytes() / input_ratio), ws),
        codec_forward=forward.codec_seconds(raw),
        codec_backward=backward.codec_seconds(raw),
        codec_dense=dense.codec_seconds(w.dense_params * w.value_bytes),
    )
