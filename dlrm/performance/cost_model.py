"""Iteration-time cost model of table-wise sharded DLRM training with compressed all-to-alls.

Pure arithmetic (no torch, TorchRec or trainer import), so that the trainer, the benchmarks and a
user's notebook can price a configuration before running it. Seconds, bytes and bytes/s throughout.

One training iteration on ``N`` ranks, each with ``b`` samples and a balanced share of tables, on
one node whose link gives each rank ``B`` bytes/s::

    T = compute + a2a_fwd + a2a_bwd + allreduce + input_dist + codec_fwd + codec_bwd
    a2a_d   = latency + bytes_a2a / (ratio_d * B)          bytes_a2a = (N-1)/N * b * sum(dims) * 4
    codec_d = bytes_a2a / encode_d + bytes_a2a / decode_d  (each rank encodes what it sends and
                                                            decodes as much as it receives)
    allreduce = latency + 2 (N-1)/N * dense_params * 4 / B (ring all-reduce of the dense MLPs)

The network (:mod:`dlrm.performance.network`) is a :class:`~dlrm.performance.network.Link` (one
node) or a :class:`~dlrm.performance.network.Topology` (nodes of ``g`` ranks, each collective
priced on the intra- and inter-node links it crosses); :func:`iteration_time` is one builder for
both, a single node being the two-level model with one node. Nothing overlaps in
:func:`iteration_time`, so it is an upper bound where TorchRec overlaps communication with
compute. :class:`Breakdown` is the one iteration-time model of the project: everything in
sequence except the dense all-reduce, which overlaps the compute after the backward all-to-all
(``compute_overlapped``, as DDP's buckets do); the strategy search (:mod:`dlrm.performance.search`)
prices its timeline with it, and the no-overlap model here is its case ``compute_overlapped=0``.

For one table or one payload the model reduces to the published per-table speedup of Feng et al.
(notes/papers.md §1.2): ``1 / (1/CR + B (1/Tc + 1/Td))`` - see :func:`table_speedup` - and the
choice of codec stages (:func:`choose_stages`) is the argmin of its denominator, the seconds each
raw byte costs.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import NamedTuple, TypeVar

from .network import INF, Collective, Link, Topology, positive, ring_allreduce_bytes

# Feng et al. (SC'24) time breakdown of uncompressed training, 32 A100s, `paper_script/stack_bar.py`
# (notes/papers.md §1.4): the all-to-alls are 62.6% of the iteration.
PUBLISHED_BREAKDOWN = {"a2a_forward": 0.313, "a2a_backward": 0.313, "allreduce": 0.229, "compute": 0.145}
PUBLISHED_SPEEDUP = 1.38  # the paper's headline, forward all-to-all compressed only (Terabyte)


@dataclass(frozen=True)
class Workload:
    """What one iteration moves and computes: ranks, batch, table dims, dense parameters, compute."""

    ranks: int
    batch_per_rank: int
    dims: tuple[int, ...]  # embedding dim of every table (all sharded table-wise over the ranks)
    dense_params: int = 0  # data-parallel (all-reduced) parameters
    compute_s: float = 0.0  # forward + backward + optimizer, without communication or codec
    value_bytes: int = 4  # fp32 pooled embeddings and gradients
    input_bytes_per_lookup: int = 12  # input dist: an int64 id and an int32 length per (sample, table)

    def __post_init__(self) -> None:
        if int(self.ranks) < 1 or int(self.batch_per_rank) < 1:
            raise ValueError(
                f"Workload needs ranks >= 1 and batch_per_rank >= 1, got {self.ranks}, {self.batch_per_rank}"
            )
        if not self.dims or any(int(d) < 1 for d in self.dims):
            raise ValueError(f"Workload.dims must list positive table dims, got {self.dims!r}")
        if self.compute_s < 0 or self.dense_params < 0:
            raise ValueError("Workload.compute_s and dense_params must be >= 0")

    def a2a_bytes(self) -> float:
        """Uncompressed bytes one rank sends in one direction's pooled-embedding all-to-all.

        Each rank keeps the rows of its own samples: (N-1)/N of its tables' output travels.
        """
        n = self.ranks
        return (n - 1) / n * self.batch_per_rank * sum(self.dims) * self.value_bytes

    def allreduce_bytes(self) -> float:
        """Bytes one rank sends in a ring all-reduce of the dense parameters."""
        return ring_allreduce_bytes(self.dense_params, self.ranks, self.value_bytes)

    def input_dist_bytes(self) -> float:
        """Bytes one rank sends in the sparse input all-to-all (single-valued features)."""
        n = self.ranks
        return (n - 1) / n * self.batch_per_rank * len(self.dims) * self.input_bytes_per_lookup


@dataclass(frozen=True)
class CodecCost:
    """One direction's codec: wire ratio (raw/wire) and encode/decode throughput in raw bytes/s."""

    ratio: float = 1.0
    encode_bytes_per_s: float = INF
    decode_bytes_per_s: float = INF

    def __post_init__(self) -> None:
        positive("CodecCost.ratio", self.ratio)
        positive("CodecCost.encode_bytes_per_s", self.encode_bytes_per_s, allow_inf=True)
        positive("CodecCost.decode_bytes_per_s", self.decode_bytes_per_s, allow_inf=True)

    def codec_seconds(self, raw_bytes: float) -> float:
        """Encode plus decode time of ``raw_bytes``."""
        return raw_bytes / self.encode_bytes_per_s + raw_bytes / self.decode_bytes_per_s

    def seconds_per_byte(self, link_bytes_per_s: float) -> float:
        """What one raw byte costs end to end: wire time at the link rate plus codec time."""
        return 1.0 / (self.ratio * link_bytes_per_s) + 1.0 / self.encode_bytes_per_s + 1.0 / self.decode_bytes_per_s


NO_CODEC = CodecCost()


@dataclass(frozen=True)
class Breakdown:
    """Seconds per iteration, by component."""

    compute: float
    a2a_forward: float
    a2a_backward: float
    allreduce: float = 0.0
    input_dist: float = 0.0
    codec_forward: float = 0.0
    codec_backward: float = 0.0
    codec_dense: float = 0.0  # encode + decode of the dense gradients (dense_comm hooks)
    codec_input: float = 0.0  # encode + decode of the input all-to-all's ids (compression.input)
    # compute after the backward all-to-all that the dense all-reduce overlaps (DDP's buckets)
    compute_overlapped: float = 0.0

    @property
    def total(self) -> float:
        """Seconds of the iteration: the components in sequence, but the dense all-reduce and the
        compute after the backward all-to-all side by side (the longer of the two counts)."""
        serial = sum(getattr(self, f.name) for f in fields(self) if f.name not in _OVERLAPPING)
        return serial + max(self.allreduce, self.compute_overlapped)

    @property
    def a2a(self) -> float:
        """Both pooled-embedding all-to-alls (wire time, codec excluded)."""
        return self.a2a_forward + self.a2a_backward

    @property
    def a2a_share(self) -> float:
        """Fraction of the iteration spent in the two all-to-alls (the published 62.6%)."""
        return self.a2a / self.total

    def shares(self) -> dict[str, float]:
        """Every component as a fraction of the total."""
        t = self.total
        return {f.name: getattr(self, f.name) / t for f in fields(self)}

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


_OVERLAPPING = ("allreduce", "compute_overlapped")


def iteration_time(
    w: Workload,
    network: Link | Topology,
    forward: CodecCost = NO_CODEC,
    backward: CodecCost = NO_CODEC,
    dense: CodecCost = NO_CODEC,
    allreduce: str = "ring",
    dense_collectives: tuple[Collective, ...] | None = None,
    input_ratio: float = 1.0,
) -> Breakdown:
    """The modelled iteration of workload ``w`` on ``network`` with these codecs, from first principles.

    ``network``: a :class:`Link` (every rank in one node on it: ``Topology.one_level``) or a
    :class:`Topology`. The all-to-alls (and the input dist, its bytes divided by ``input_ratio``)
    are pairwise; the dense all-reduce is ``allreduce`` (``ring`` or ``hierarchical``) with its
    bytes divided by ``dense``'s ratio, or, given ``dense_collectives`` (e.g.
    :func:`~dlrm.performance.network.sparse_aggregation`), those instead. ``dense``'s throughput
    applies to the fp32 gradients (``4 * dense_params`` bytes).
    """
    topo = network if isinstance(network, Topology) else Topology.one_level(network, w.ranks)
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


def with_codecs(
    base: Breakdown,
    raw_bytes: float,
    forward: CodecCost = NO_CODEC,
    backward: CodecCost = NO_CODEC,
    latency_s: float = 0.0,
    dense: CodecCost = NO_CODEC,
    dense_bytes: float = 0.0,
) -> Breakdown:
    """An uncompressed breakdown (measured or published) with codecs applied to its all-to-alls
    and, with ``dense``, to its all-reduce.

    The bandwidth part of each collective (beyond ``latency_s``) shrinks by its ratio; encode and
    decode of ``raw_bytes`` (what one rank sends per direction) and of ``dense_bytes`` (the fp32
    dense gradients) are added.
    """

    def shrink(t: float, c: CodecCost) -> float:
        fixed = min(latency_s, t)
        return fixed + (t - fixed) / c.ratio

    return replace(
        base,
        a2a_forward=shrink(base.a2a_forward, forward),
        a2a_backward=shrink(base.a2a_backward, backward),
        allreduce=shrink(base.allreduce, dense),
        codec_forward=base.codec_forward + forward.codec_seconds(raw_bytes),
        codec_backward=base.codec_backward + backward.codec_seconds(raw_bytes),
        codec_dense=base.codec_dense + dense.codec_seconds(dense_bytes),
    )


def exposed_input_dist(input_s: float, iteration: Breakdown) -> float:
    """Seconds an input all-to-all of ``input_s`` on the link adds to ``iteration`` (which leaves it
    out). TorchRec's pipeline runs the next batch's input dist a batch ahead, beside this batch's
    compute, so it takes the link while the other collectives leave it idle; only what does not
    fit there delays the iteration (an optimistic bound: the idle time is taken as one piece)."""
    busy = iteration.a2a_forward + iteration.a2a_backward + iteration.allreduce
    return max(input_s - max(iteration.total - busy, 0.0), 0.0)


def with_input(iteration: Breakdown, input_s: float, codec_s: float = 0.0) -> Breakdown:
    """``iteration`` with its input all-to-all: ``input_s`` on the link, pipelined
    (:func:`exposed_input_dist`), and ``codec_s`` of coding its ids on the compute path."""
    without = replace(iteration, input_dist=0.0)
    return replace(
        without,
        input_dist=exposed_input_dist(input_s, without),
        codec_input=iteration.codec_input + codec_s,
    )


def from_shares(shares: Mapping[str, float], a2a_forward_s: float) -> Breakdown:
    """Absolute times from a published breakdown (fractions by component) and the forward
    all-to-all's time, e.g. raw bytes / link bandwidth of the published cluster."""
    known = {f.name for f in fields(Breakdown)}
    unknown = sorted(set(shares) - known)
    if unknown:
        raise ValueError(f"breakdown shares have unknown component(s) {unknown}; known: {sorted(known)}")
    if not shares.get("a2a_forward", 0) > 0:
        raise ValueError("breakdown shares need a positive a2a_forward share to scale from")
    total = float(a2a_forward_s) / shares["a2a_forward"]
    return Breakdown(
        **{**{k: 0.0 for k in ("compute", "a2a_forward", "a2a_backward")}, **{k: v * total for k, v in shares.items()}}
    )


def project_published(
    w: Workload,
    link_bytes_per_s: float,
    forward: CodecCost,
    backward: CodecCost,
    shares: Mapping[str, float] = PUBLISHED_BREAKDOWN,
    dense: CodecCost | None = None,
) -> dict[str, Breakdown]:
    """A published setup: its breakdown scaled to ``w``'s forward all-to-all at the link rate,
    then compressed forward only (what Feng et al. did), in both directions (what we do), and
    with ``dense`` also the dense all-reduce (``all``; its codec time on ``4 * w.dense_params``)."""
    raw = w.a2a_bytes()
    base = from_shares(shares, raw / positive("link_bytes_per_s", link_bytes_per_s))
    out = {
        "uncompressed": base,
        "forward_only": with_codecs(base, raw, forward, NO_CODEC),
        "forward_backward": with_codecs(base, raw, forward, backward),
    }
    if dense is not None:
        out["all"] = with_codecs(base, raw, forward, backward, dense=dense, dense_bytes=w.dense_params * w.value_bytes)
    return out


def project_input(iteration: Breakdown, w: Workload, link_bytes_per_s: float, coded: CodecCost) -> dict[str, Breakdown]:
    """``iteration`` (a projection without its input dist) with ``w``'s input all-to-all added,
    pipelined (:func:`with_input`) on ``link_bytes_per_s`` per rank: ``raw`` as TorchRec sends it,
    and ``coded`` at ``coded.ratio`` with ``coded``'s throughput on the raw input bytes."""
    raw, link = w.input_dist_bytes(), positive("link_bytes_per_s", link_bytes_per_s, allow_inf=True)
    return {
        "raw": with_input(iteration, raw / link),
        "coded": with_input(iteration, raw / coded.ratio / link, coded.codec_seconds(raw)),
    }


def calibrate_compute(measured_total_s: float, modelled: Breakdown) -> Breakdown:
    """``modelled`` with its compute set so that its total equals a measured iteration time
    (the residual after the modelled communication and codec; errors if that is negative)."""
    rest = modelled.total - modelled.compute
    compute = float(measured_total_s) - rest
    if compute < 0:
        raise ValueError(
            f"measured {measured_total_s:.4g} s per iteration is less than the modelled "
            f"communication and codec time {rest:.4g} s: the link or byte counts are wrong"
        )
    return replace(modelled, compute=compute)


def speedup(base: Breakdown, new: Breakdown) -> float:
    """Iteration-time ratio: how much faster ``new`` trains than ``base``."""
    return base.total / new.total


def amdahl_limit(share: float) -> float:
    """The speedup cap when only a fraction ``share`` of the time can shrink (to zero)."""
    if not 0 <= share < 1:
        raise ValueError(f"share must be in [0, 1), got {share!r}")
    return 1.0 / (1.0 - share)


def table_speedup(ratio: float, link_bytes_per_s: float, encode_bytes_per_s: float, decode_bytes_per_s: float) -> float:
    """Feng et al.'s per-table speedup of one transfer: ``1 / (1/CR + B (1/Tc + 1/Td))``."""
    c = CodecCost(ratio, encode_bytes_per_s, decode_bytes_per_s)
    return 1.0 / (c.seconds_per_byte(positive("link_bytes_per_s", link_bytes_per_s)) * link_bytes_per_s)


class Stages(NamedTuple):
    """The optional stages of the lossy codec: an entropy coder (zstd) after quantisation, and
    deduplication of identical rows. ``codec_params()`` gives ``compression.get_codec("lossy", ...)``
    keyword arguments."""

    entropy: bool
    dedup: bool

    def codec_params(self) -> dict[str, bool]:
        return {"entropy": self.entropy, "dedup": self.dedup}


K = TypeVar("K", bound=Hashable)


def choose_stages(
    ratio_by_stage: Mapping[K, float], throughput_by_stage: Mapping[K, tuple[float, float]], link_bytes_per_s: float
) -> K:
    """The stage configuration that moves a raw byte fastest over this link.

    ``ratio_by_stage`` maps each candidate (e.g. :class:`Stages`) to its measured wire ratio,
    ``throughput_by_stage`` to its (encode, decode) throughput in raw bytes/s, and
    ``link_bytes_per_s`` is the bandwidth one rank gets (``Link.per_rank_bytes_per_s``). Slow links
    favour the stronger ratio (entropy on), fast links the faster codec. Ties go to the candidate
    with fewer stages switched on, then to the first given.
    """
    link = positive("link_bytes_per_s", link_bytes_per_s, allow_inf=True)
    if not ratio_by_stage:
        raise ValueError("choose_stages needs at least one candidate")
    missing = [k for k in ratio_by_stage if k not in throughput_by_stage]
    if missing:
        raise ValueError(f"no (encode, decode) throughput for stage choice(s) {missing}")

    def cost(item: tuple[int, K]) -> tuple[float, int, int]:
        i, k = item
        enc, dec = throughput_by_stage[k]
        c = CodecCost(ratio_by_stage[k], enc, dec)
        on = sum(bool(v) for v in k) if isinstance(k, tuple) else 0
        wire = 0.0 if link == INF else 1.0 / (c.ratio * link)
        return wire + 1.0 / c.encode_bytes_per_s + 1.0 / c.decode_bytes_per_s, on, i

    return min(enumerate(ratio_by_stage), key=cost)[1]


def choose_stages_per_table(
    ratio_by_table: Mapping[str, Mapping[K, float]],
    throughput_by_stage: Mapping[K, tuple[float, float]],
    link_bytes_per_s: float,
) -> dict[str, K]:
    """:func:`choose_stages` for every table (ratios differ by table, throughputs by stage)."""
    return {t: choose_stages(r, throughput_by_stage, link_bytes_per_s) for t, r in ratio_by_table.items()}


def crossover_bandwidth(a: CodecCost, b: CodecCost) -> float | None:
    """The link rate at which ``a`` and ``b`` cost the same per raw byte (None: one always wins).

    Below it the codec with the higher ratio wins, above it the faster one.
    """
    wire = 1.0 / a.ratio - 1.0 / b.ratio  # coefficient of 1/B in cost(a) - cost(b)
    codec = (
        1.0 / b.encode_bytes_per_s
        + 1.0 / b.decode_bytes_per_s
        - 1.0 / a.encode_bytes_per_s
        - 1.0 / a.decode_bytes_per_s
    )
    if wire == 0 or codec == 0 or (wire > 0) != (codec > 0):
        return None
    return wire / codec


def harmonic_ratio(raw_bytes: Sequence[float], ratios: Sequence[float]) -> float:
    """Aggregate ratio of several tables: total raw bytes over total wire bytes."""
    if len(raw_bytes) != len(ratios) or not raw_bytes:
        raise ValueError("harmonic_ratio needs one ratio per raw byte count")
    return sum(raw_bytes) / sum(r / positive("ratio", c) for r, c in zip(raw_bytes, ratios, strict=True))
