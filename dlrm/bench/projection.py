"""Projections to 1,024 GPUs: bytes per rank and iteration time of every configuration, from the
two-level cost model (:mod:`dlrm.performance.network`) with stated inputs and our measured ratios.

``python -m dlrm.bench.projection`` prints the table (markdown) for each inter-node rate and, with
``--plot FILE``, draws iteration time against GPUs (matplotlib). Every input is a named constant
below, with where it comes from; nothing here is a measurement of a GPU cluster.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dlrm.performance.cost_model import NO_CODEC, Breakdown, CodecCost, Workload, iteration_time
from dlrm.performance.network import Collective, Link, Topology, cheaper_aggregation, sparse_aggregation
from dlrm.performance.search import Option, Timeline, Unit, choose

GB = 1e9
GPUS = (8, 32, 64, 256, 1024)
RANKS_PER_NODE = 8
# intra-node NVLink per GPU and direction: A100 (NVLink 3, 600 GB/s both ways), H100 (NVLink 4, 900)
INTRA_BYTES_PER_S = {"a100": 300 * GB, "h100": 450 * GB}
# inter-node rate per GPU (a NIC per GPU, as in DGX A100's 8 x 200 Gbit/s HDR and DGX H100's 8 x 400)
INTER_GBIT = (100, 200, 400)
LATENCY_S = {"intra": 5e-6, "inter": 20e-6}  # per collective (assumed, NCCL-class)

# The Terabyte recipe of Feng et al. (notes/papers.md), 2,048 samples per GPU; 762,177 dense
# parameters (docs/results.md); compute 1.5 ms per iteration on an A100: the published breakdown's
# 14.5% of the iteration whose forward all-to-all (31.3%) is 13.2 MB at 4 GB/s (docs/cost_model.md).
WORKLOAD = Workload(ranks=8, batch_per_rank=2048, dims=(64,) * 26, dense_params=762_177, compute_s=1.5e-3)

# Codec throughputs (raw bytes/s, encode / decode; inputs, not measured here): the lossy codec at
# cuSZp2's A100 figures (docs/cost_model.md); casts (fp16, MX4) at TorchRec's Triton qcomm kernels'
# ~2.1 TB/s (notes/wave3.md §3; MX4 assumed as fast as fp16); the dense codecs (DCT's threshold,
# PowerSGD) and the ids codec assumed at 100 GB/s.
CAST_TPUT = (2100 * GB, 2100 * GB)
LOSSY_TPUT = (332 * GB, 513 * GB)
DENSE_TPUT = (100 * GB, 100 * GB)
# Measured ratios (docs/results.md, 2 ranks, full runs of the Terabyte MLPs at dim 64: lossy 37.6 /
# 47.3 forward / backward, DCT at keep 0.5% 610x, PowerSGD rank 1 72x; docs/compression.md: MX4
# 6.4 / 7.1, the coded input 11.06x at 1,024 lookups per table and rank).
RATIOS = {"fp16": (2.0, 2.0), "mx4": (6.4, 7.1), "lossy": (37.6, 47.3)}
DCT_RATIO, POWERSGD_RATIO, IDS_RATIO = 610.0, 72.0, 11.06
DCT_HEADER = 168  # bytes of a DCT payload's header (ThresholdCodec.payload_size with no entry)

CONFIGS = (
    "none",
    "qcomm_fp16",
    "qcomm_mx4",
    "lossy",
    "lossy+dct",
    "lossy+dct (reduce_scatter)",
    "lossy+powersgd",
    "lossy+dct+input=ids",
    "auto+auto",
)


def _codec(kind: str, direction: int, lossy_tput: tuple[float, float] = LOSSY_TPUT) -> CodecCost:
    if kind == "none":
        return NO_CODEC
    tput = lossy_tput if kind == "lossy" else CAST_TPUT
    return CodecCost(RATIOS[kind][direction], *tput)


def measured_lossy_tput(path: str, w: Workload = WORKLOAD) -> tuple[float, float]:
    """The lossy codec's encode and decode throughput for the projection, from a GPU run of
    ``python -m dlrm.bench.gpu_collective --json PATH``: its per-collective codec time (both
    directions, one peer) fitted as a fixed cost plus a cost per raw byte over the measured chunk
    sizes, taken at one peer's chunk of this workload, half to each of encode and decode (the
    cost model adds the two)."""
    import json

    data = json.loads(Path(path).read_text())
    if not str(data.get("device", "")).startswith("cuda"):
        raise SystemExit(f"{path}: measured on {data.get('device')!r}; the projection takes a GPU's codec times")
    pts = [(r["raw_bytes"], r["codec_ms"] / 1e3) for r in data["rows"] if r["config"] == "lossy" and "codec_ms" in r]
    if len(pts) < 2:
        raise SystemExit(f"{path}: the lossy codec at two chunk sizes at least is needed for the fit")
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    fixed = max(my - slope * mx, 0.0)
    raw = 2 * w.batch_per_rank * sum(w.dims) * 4  # one peer's chunk, both directions, fp32
    tput = raw / (fixed + max(slope, 0.0) * raw)
    return 2 * tput, 2 * tput


@dataclass(frozen=True)
class Row:
    """One configuration at one size: bytes one rank sends per iteration, and the iteration."""

    config: str
    gpus: int
    bytes_per_rank: float
    inter_bytes_per_rank: float
    breakdown: Breakdown
    choice: str = ""

    @property
    def ms(self) -> float:
        return 1e3 * self.breakdown.total


def topology(inter_gbit: float, gpu: str = "a100", ranks_per_node: int = RANKS_PER_NODE) -> Topology:
    """The stated cluster: NVLink inside a node, a NIC of ``inter_gbit`` per GPU across."""
    intra = Link(INTRA_BYTES_PER_S[gpu], latency_s=LATENCY_S["intra"])
    return Topology(ranks_per_node, intra, Link(inter_gbit * 1e9 / 8, latency_s=LATENCY_S["inter"]))


def _dense(w: Workload, dense: str) -> tuple[tuple[Collective, ...], CodecCost]:
    """The dense gradients' collectives and codec: a ring all-reduce, or DCT's sparse aggregation."""
    values = w.dense_params * w.value_bytes
    if dense.startswith("dct"):
        payload = values / DCT_RATIO
        body = payload - DCT_HEADER
        agg = dense.partition(":")[2] or "allgather"
        agg = cheaper_aggregation(body, w.ranks, DCT_HEADER) if agg == "auto" else agg
        return sparse_aggregation(body, w.ranks, agg, DCT_HEADER), CodecCost(1.0, *DENSE_TPUT)
    ratio = {"none": 1.0, "fp16": 2.0, "powersgd": POWERSGD_RATIO}[dense]
    codec = NO_CODEC if dense == "none" else CodecCost(1.0, *(CAST_TPUT if dense == "fp16" else DENSE_TPUT))
    return (Collective("ring", 2 * (w.ranks - 1) / w.ranks * values / ratio),), codec


def price(
    w: Workload,
    topo: Topology,
    a2a: str | tuple[str, str],
    dense: str,
    ids: bool = False,
    lossy_tput: tuple[float, float] = LOSSY_TPUT,
) -> tuple[Breakdown, float, float]:
    """The iteration of all-to-all codec ``a2a`` (or a (forward, backward) pair) and dense codec
    ``dense``: its breakdown and the bytes one rank sends (all, and across nodes)."""
    kinds = (a2a, a2a) if isinstance(a2a, str) else a2a
    fwd, bwd = _codec(kinds[0], 0, lossy_tput), _codec(kinds[1], 1, lossy_tput)
    collectives, dense_codec = _dense(w, dense)
    input_ratio = IDS_RATIO if ids else 1.0
    b = iteration_time(w, topo, fwd, bwd, dense_codec, dense_collectives=collectives, input_ratio=input_ratio)
    if ids:  # the ids codec's time, on the forward's compute path
        b = _plus_codec(b, CodecCost(1.0, *DENSE_TPUT).codec_seconds(w.input_dist_bytes()))
    sent = [
        Collective("pairwise", w.a2a_bytes() / fwd.ratio),
        Collective("pairwise", w.a2a_bytes() / bwd.ratio),
        Collective("pairwise", w.input_dist_bytes() / input_ratio),
        *collectives,
    ]
    split = [topo.crossing(c, w.ranks) for c in sent]
    return b, sum(i + x for i, x in split), sum(x for _, x in split)


def _plus_codec(b: Breakdown, seconds: float) -> Breakdown:
    return Breakdown(**{**b.as_dict(), "codec_forward": b.codec_forward + seconds})


def auto_choice(w: Workload, topo: Topology, lossy_tput: tuple[float, float] = LOSSY_TPUT) -> tuple[str, str, str]:
    """What ``compression=auto dense_comm=auto``'s search (:func:`dlrm.performance.search.choose`)
    picks on this topology, from the options' stated ratios and throughputs."""
    raw = w.a2a_bytes()
    ring = 2 * (w.ranks - 1) / w.ranks * w.dense_params * w.value_bytes

    def a2a(direction: int) -> tuple[Option, ...]:
        out = [Option("none")]
        for kind in ("fp16", "mx4", "lossy"):
            c = _codec(kind, direction, lossy_tput)
            out.append(Option(kind, c.ratio, raw / c.encode_bytes_per_s, raw / c.decode_bytes_per_s))
        return tuple(out)

    dense_opts = []
    for name in ("none", "fp16", "powersgd", "dct:auto"):
        collectives, codec = _dense(w, name)
        wire = sum(c.bytes_per_rank for c in collectives)
        raw_dense = w.dense_params * w.value_bytes
        codec_s = codec.codec_seconds(raw_dense) / 2
        dense_opts.append(Option(name, ring / wire, codec_s, codec_s))
    units = [
        Unit("forward/all", "forward", raw, a2a(0)),
        Unit("backward/all", "backward", raw, a2a(1)),
        Unit("dense", "dense", ring, tuple(dense_opts)),
    ]
    timeline = Timeline(topo.inter, w.ranks, between=w.compute_s, topology=topo)
    choice = choose(units, timeline, start={u.name: "none" for u in units})
    return choice["forward/all"], choice["backward/all"], choice["dense"]


def project(
    gpus: Sequence[int] = GPUS,
    inter_gbit: float = 200,
    gpu: str = "a100",
    w: Workload = WORKLOAD,
    lossy_tput: tuple[float, float] = LOSSY_TPUT,
) -> list[Row]:
    """Every configuration at every size (``ranks_per_node`` 8; fewer GPUs than 8 are one node);
    ``lossy_tput``: the lossy codec's encode and decode throughput (:func:`measured_lossy_tput`)."""
    rows = []
    for n in gpus:
        wn = Workload(**{**w.__dict__, "ranks": n})
        topo = topology(inter_gbit, gpu)
        for config in CONFIGS:
            choice = ""
            if config == "auto+auto":
                fwd, bwd, dense = auto_choice(wn, topo, lossy_tput)
                a2a: str | tuple[str, str] = (fwd, bwd)
                choice = f"{fwd}/{bwd}+{dense.replace('dct:auto', 'dct')}"
                ids = False
            else:
                a2a = {"none": "none", "qcomm_fp16": "fp16", "qcomm_mx4": "mx4"}.get(config, "lossy")
                dense = "none"
                if "dct" in config:
                    dense = "dct:reduce_scatter" if "reduce_scatter" in config else "dct:allgather"
                elif "powersgd" in config:
                    dense = "powersgd"
                ids = "input=ids" in config
            b, sent, across = price(wn, topo, a2a, dense, ids, lossy_tput)
            rows.append(Row(config, n, sent, across, b, choice))
    return rows


def table(rows: Sequence[Row]) -> str:
    """Markdown: one row per configuration, per size MB sent per rank and ms per iteration."""
    gpus = sorted({r.gpus for r in rows})
    head = "| config | " + " | ".join(f"{n} GPUs: MB/rank, ms" for n in gpus) + " |"
    lines = [head, "| --- |" + " ---: |" * len(gpus)]
    for config in CONFIGS:
        cells = []
        for n in gpus:
            r = next(r for r in rows if r.config == config and r.gpus == n)
            extra = f" ({r.choice})" if r.choice else ""
            cells.append(f"{r.bytes_per_rank / 1e6:.3g}, {r.ms:.2f}{extra}")
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(path: str, gpu: str = "a100", rates: Sequence[float] = INTER_GBIT) -> None:
    """Iteration time (top) and MB sent per rank (bottom) against GPUs, one column per rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(2, len(rates), figsize=(5 * len(rates), 7.5), sharey="row", squeeze=False)
    for col, rate in enumerate(rates):
        rows = project(inter_gbit=rate, gpu=gpu)
        top, bottom = grid[0][col], grid[1][col]
        for config in CONFIGS:
            pts = [r for r in rows if r.config == config]
            top.plot([r.gpus for r in pts], [r.ms for r in pts], marker="o", label=config)
            bottom.plot([r.gpus for r in pts], [r.bytes_per_rank / 1e6 for r in pts], marker="o", label=config)
        top.set_title(f"{gpu.upper()} NVLink, {rate:g} Gbit/s per GPU across nodes")
        bottom.set_yscale("log")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xticks(list(GPUS), [str(n) for n in GPUS])
            ax.set_xlabel("GPUs (8 per node)")
            ax.grid(True, which="both", alpha=0.3)
    grid[0][0].set_ylabel("modelled ms per iteration")
    grid[1][0].set_ylabel("MB sent per rank per iteration")
    grid[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dlrm.bench.projection", description=__doc__.split("\n")[0])
    p.add_argument("--gpu", choices=sorted(INTRA_BYTES_PER_S), default="a100")
    p.add_argument("--inter-gbit", type=float, action="append", help="inter-node Gbit/s per GPU (repeatable)")
    p.add_argument("--plot", help="also draw iteration time against GPUs into this file (png/svg)")
    p.add_argument(
        "--measured",
        help="the lossy codec's times measured on a GPU (python -m dlrm.bench.gpu_collective --json FILE) "
        f"in place of the assumed {LOSSY_TPUT[0] / GB:.0f} / {LOSSY_TPUT[1] / GB:.0f} GB/s",
    )
    args = p.parse_args(argv)
    lossy_tput = measured_lossy_tput(args.measured) if args.measured else LOSSY_TPUT
    source = f"measured ({args.measured})" if args.measured else "assumed (cuSZp2's A100 figures)"
    print(f"lossy codec: {lossy_tput[0] / GB:.3g} / {lossy_tput[1] / GB:.3g} GB/s encode / decode, {source}")
    for rate in args.inter_gbit or INTER_GBIT:
        if not (rate > 0 and math.isfinite(rate)):
            p.error(f"--inter-gbit must be a positive number, got {rate}")
        print(f"\n{args.gpu.upper()}, {rate:g} Gbit/s per GPU across nodes, {RANKS_PER_NODE} GPUs per node\n")
        print(table(project(inter_gbit=rate, gpu=args.gpu, lossy_tput=lossy_tput)))
    if args.plot:
        plot(args.plot, args.gpu, args.inter_gbit or INTER_GBIT)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
