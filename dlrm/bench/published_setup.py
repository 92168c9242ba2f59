"""The published 32-GPU Terabyte setup (Feng et al., SC'24) projected under the cost model with the
wire ratios a benchmark measured: the closing lines of :mod:`dlrm.bench.netbench`'s report."""

from __future__ import annotations

from typing import Protocol

from dlrm.bench import netreport
from dlrm.performance import cost_model as cm

# A100-class throughput of a fixed-length GPU codec (cuSZp2, notes/peers.md §6) and the link rate
# the authors' own model script uses (notes/papers.md §1.2, cr_log.py: B = 4 GB/s).
PUBLISHED_CODEC_GBPS = (332.0, 513.0)
PUBLISHED_LINK_GBPS = 4.0
# The Terabyte MLPs (13-512-256-64 bottom, 415-512-512-256-1 top): their weights and biases.
PUBLISHED_DENSE_PARAMS = (
    13 * 512 + 512 + 512 * 256 + 256 + 256 * 64 + 64 + 415 * 512 + 512 + 512 * 512 + 512 + 512 * 256 + 256 + 256 + 1
)
# Harmonic mean over the 26 Terabyte tables of the authors' Huffman ratios (notes/papers.md §1.6).
PUBLISHED_RATIO = 10.8


class Setup(Protocol):
    """What a projection reads of the benchmark's options."""

    @property
    def codec_gbps(self) -> tuple[float, float]: ...  # encode, decode
    @property
    def cluster_gbps(self) -> float: ...
    @property
    def nproc(self) -> int: ...  # the ranks the ratios were measured on


def projection_lines(
    summaries: list[netreport.Summary], o: Setup, label: str = "lossy", dense_label: str = "lossy+dct"
) -> list[str]:
    """The published 32-GPU Terabyte setup under the cost model with our measured wire ratios
    (the all-to-alls' of ``label``, and the dense all-reduce's of ``dense_label`` if it ran)."""
    ours = [s for s in summaries if s.label == label]
    if not ours:
        return [f"(no {label!r} runs: no projection of the published setup)"]
    slow = min(ours, key=lambda s: netreport.rate_bytes_per_s(s.rate))
    enc, dec = (g * 1e9 for g in o.codec_gbps)
    w = cm.Workload(ranks=32, batch_per_rank=2048, dims=(64,) * 26, dense_params=PUBLISHED_DENSE_PARAMS)
    link = o.cluster_gbps * 1e9
    fwd = cm.CodecCost(slow.wire_ratio["forward"], enc, dec)
    bwd = cm.CodecCost(slow.wire_ratio["backward"], enc, dec)
    p = cm.project_published(w, link, fwd, bwd)
    published = cm.CodecCost(PUBLISHED_RATIO, enc, dec)
    q = cm.project_published(w, link, published, published)
    base = p["uncompressed"]
    return [
        f"Published setup (32 GPUs, Terabyte: 26 tables x 64, 2,048/GPU; {w.a2a_bytes() / 1e6:.1f} MB per rank "
        f"and direction) at {o.cluster_gbps:g} GB/s per GPU, codec {o.codec_gbps[0]:g}/{o.codec_gbps[1]:g} GB/s "
        f"(encode/decode, A100-class input), our {label} wire ratios at {slow.rate} "
        f"({slow.wire_ratio['forward']:.1f}x fwd, {slow.wire_ratio['backward']:.1f}x bwd), published breakdown "
        f"{', '.join(f'{k} {100 * v:.1f}%' for k, v in cm.PUBLISHED_BREAKDOWN.items())}:",
        f"  forward only:       {cm.speedup(base, p['forward_only']):.3f}x (published {cm.PUBLISHED_SPEEDUP}x; "
        f"Amdahl cap {cm.amdahl_limit(cm.PUBLISHED_BREAKDOWN['a2a_forward']):.3f}x)",
        f"  forward + backward: {cm.speedup(base, p['forward_backward']):.3f}x "
        f"(Amdahl cap {cm.amdahl_limit(base.a2a_share):.3f}x)",
        f"  with the published Huffman ratio ({PUBLISHED_RATIO:g}x, both directions): forward only "
        f"{cm.speedup(base, q['forward_only']):.3f}x, "
        f"forward + backward {cm.speedup(base, q['forward_backward']):.3f}x",
        *dense_projection(summaries, o, w, link, fwd, bwd, dense_label),
    ]


def dense_projection(
    summaries: list[netreport.Summary],
    o: Setup,
    w: cm.Workload,
    link: float,
    fwd: cm.CodecCost,
    bwd: cm.CodecCost,
    label: str,
) -> list[str]:
    """The published setup with its all-reduce (22.9%) compressed too, by ``label``'s DCT.

    DCT's sparse payloads travel in an all-gather: each rank receives every other rank's, so its
    ratio against a ring all-reduce (2 (W-1)/W x 4 bytes per value) shrinks as W/2 grows. The
    ratio measured on ``o.nproc`` ranks is scaled to ``w.ranks`` accordingly.
    """
    runs = [s for s in summaries if s.label == label]
    if not runs:
        return []
    slow = min(runs, key=lambda s: netreport.rate_bytes_per_s(s.rate))
    scaled = slow.dense_ratio * o.nproc / w.ranks
    enc, dec = (g * 1e9 for g in o.codec_gbps)
    p = cm.project_published(w, link, fwd, bwd, dense=cm.CodecCost(max(scaled, 1.0), enc, dec))
    base = p["uncompressed"]
    cap = cm.amdahl_limit(base.a2a_share + cm.PUBLISHED_BREAKDOWN["allreduce"])
    return [
        f"  forward + backward + dense all-reduce ({label}: {slow.dense_ratio:.0f}x on {o.nproc} ranks, "
        f"{scaled:.1f}x as an all-gather on {w.ranks}): {cm.speedup(base, p['all']):.3f}x (Amdahl cap {cap:.3f}x)"
    ]
