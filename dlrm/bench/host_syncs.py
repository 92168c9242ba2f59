"""Host synchronisations of one compressed chunk, by stage and op, and per iteration at W ranks.

    python -m dlrm.bench.host_syncs [--rows 2048] [--tables 13] [--dim 64] [--trace]

One chunk as a rank sends it to one peer (Criteo-like single-valued ids, bit-identical rows per
id), through the trainer's own :class:`~dlrm.embedding_comm.codec.DirectionCodec` with
``compression=lossy policy=dual`` (rel bounds, dedup by id) and the fixed-length coder used on
CUDA (``params.entropy=false``), on the device code paths (:func:`device_paths`: the host
shortcuts taken for CPU tensors off, and each ``.tolist()``/``.cpu()`` counted as a ``host_read``,
which the dispatcher cannot see on CPU tensors). Both directions are counted; the
backward also sums duplicate-id gradients (sender) and keeps one row per id (receiver). An
iteration has (W - 1) chunks per direction; the projection assumes each is like this one.
Then the static listing of the per-chunk host copies (:mod:`dlrm.bench.host_copies`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from data.layout import SPARSE_NAMES
from dlrm.bench.host_copies import host_copies
from dlrm.embedding_comm.codec import DirectionCodec
from dlrm.embedding_comm.config import parse_compression_cfg
from dlrm.embedding_comm.ids import keep_first_duplicates, sum_duplicates
from dlrm.embedding_comm.policy import build_policy, table_stats
from dlrm_compression import base, dedup, row_cache
from dlrm_compression import format as fmt
from dlrm_compression.host_syncs import HostSyncCounter
from dlrm_compression.synthetic import KAGGLE_CARDINALITIES, criteo_like_batch

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
OVERRIDES = [
    "compression=lossy",
    "policy=dual",
    "compression.forward.params.entropy=false",
    "compression.backward.params.entropy=false",
]
WORLD_SIZES = (2, 8, 64)


@contextmanager
def device_paths(counter: HostSyncCounter | None = None) -> Iterator[None]:
    """Run the codec's device code on CPU tensors (as tests do): torch's dedup, not numpy's, the
    bounds kept as a tensor, the device payload check (Adler-32) and the row cache's device
    compaction, restoring the CPU choices after. With ``counter``, each ``.tolist()`` /
    ``.cpu()`` of a tensor also counts, as ``host_read``: on a device each is a copy to the host
    that waits, and the dispatcher cannot see them on CPU tensors."""
    saved = dedup.HOST_NUMPY, fmt._check_for, torch.Tensor.tolist, torch.Tensor.cpu, base.HOST_BOUNDS
    shortcuts = row_cache.HOST_SHORTCUTS
    dedup.HOST_NUMPY = base.HOST_BOUNDS = row_cache.HOST_SHORTCUTS = False
    fmt._check_for = lambda device: "adler32"
    if counter is not None:

        def reads(method: Callable[..., Any]) -> Callable[..., Any]:
            def wrapped(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                f = sys._getframe(1)
                counter.note("host_read", f"{os.path.relpath(f.f_code.co_filename)}:{f.f_lineno}")
                return method(t, *args, **kwargs)

            return wrapped

        torch.Tensor.tolist = reads(saved[2])  # type: ignore[method-assign]
        torch.Tensor.cpu = reads(saved[3])  # type: ignore[method-assign]
    try:
        yield
    finally:
        dedup.HOST_NUMPY, fmt._check_for, base.HOST_BOUNDS = saved[0], saved[1], saved[4]
        row_cache.HOST_SHORTCUTS = shortcuts
        torch.Tensor.tolist, torch.Tensor.cpu = saved[2], saved[3]  # type: ignore[method-assign]


def codecs(features: Sequence[str], dim: int) -> dict[str, DirectionCodec]:
    """Both directions' codecs as the trainer builds them from the composed config."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):  # as the trainer composes it
        cfg = compose("config", overrides=OVERRIDES)
    spec = parse_compression_cfg(cfg.compression)
    assert spec.forward is not None and spec.backward is not None
    rows = [KAGGLE_CARDINALITIES[i % len(KAGGLE_CARDINALITIES)] for i in range(len(features))]
    modes = {"forward": spec.forward.mode, "backward": spec.backward.mode}
    policy = build_policy(cfg.policy, table_stats(features, rows, dim), modes)
    return {
        "forward": DirectionCodec(spec.forward, "forward", policy),
        "backward": DirectionCodec(spec.backward, "backward", policy),
    }


def count_chunk(
    rows: int = 2048, tables: int = 13, dim: int = 64, seed: int = 0, trace: bool = False
) -> HostSyncCounter:
    """Count one chunk's syncs in both directions, labelled ``<direction>/<stage>``."""
    features = SPARSE_NAMES[:tables]
    dcs = codecs(features, dim)
    batch = criteo_like_batch(rows=rows, tables=tables, dim=dim, seed=seed)
    chunks = {
        "forward": torch.cat([t["values"] for t in batch.values()], 1),
        "backward": torch.randn(rows, tables * dim, generator=torch.Generator().manual_seed(seed)),
    }
    ids = torch.stack([t["ids"] for t in batch.values()], 1)
    widths = [dim] * tables
    counter = HostSyncCounter(trace=trace)
    with device_paths(counter), counter:
        for d, dc in dcs.items():
            chunk = chunks[d]
            with counter.label(f"{d}/bounds"):
                bounds = dc.bounds(chunk, widths, dc.policy(features, 0))
            if d == "backward":  # the sender sums duplicate-id gradients, the receiver keeps one row per id
                with counter.label(f"{d}/sum_duplicates"):
                    chunk = sum_duplicates(chunk, ids, widths)
            with counter.label(f"{d}/encode"):
                payload = dc.encode(chunk, widths, bounds, ids)
            with counter.label(f"{d}/decode"):
                out = dc.decode(
                    payload,
                    (rows, tables * dim),
                    ids,
                    src=1,
                    dst=0,
                    features=features,
                    tables=features,
                    iteration=0,
                    where="bench",
                )
            if d == "backward":
                with counter.label(f"{d}/keep_first"):
                    keep_first_duplicates(out, ids, widths)
    return counter


def report(counter: HostSyncCounter, world_sizes: Sequence[int] = WORLD_SIZES) -> str:
    """The table by stage and op, the total per chunk and direction, and the iteration projection."""
    ops = sorted(counter.by_op)
    lines = [f"{'stage':25}" + "".join(f"{op:>{len(op) + 2}}" for op in ops) + f"{'total':>7}"]
    for s in counter.labels:
        cells = "".join(f"{counter.counts[(s, op)] or '':>{len(op) + 2}}" for op in ops)
        lines.append(f"{s:25}{cells}{counter.by_label[s]:>7}")
    per_dir = Counter(
        {d: sum(n for s, n in counter.by_label.items() if s.startswith(d)) for d in ("forward", "backward")}
    )
    lines.append(f"per chunk: forward {per_dir['forward']}, backward {per_dir['backward']}")
    f, b = per_dir["forward"], per_dir["backward"]
    for w in world_sizes:
        total = (w - 1) * (f + b)
        lines.append(
            f"W = {w:>3}: {w - 1:>2} peers x (forward {f} + backward {b}) = {total:,} host syncs per iteration"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--tables", type=int, default=13)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", action="store_true", help="also list each sync's file:line")
    args = p.parse_args(argv)
    counter = count_chunk(args.rows, args.tables, args.dim, args.seed, args.trace)
    print(f"one chunk: {args.rows} rows x {args.tables} tables x dim {args.dim}, {' '.join(OVERRIDES)}")
    print(report(counter))
    if args.trace:
        for site, n in sorted(Counter((e.label, e.op, e.where) for e in counter.events).items()):
            print(f"  {site[0]:25} {site[1]:18} {site[2]}  x{n}")
    copies = host_copies()
    print(f"host copies in the per-chunk code (static; on CPU tensors the counter cannot see them): {len(copies)}")
    for c in copies:
        print(f"  {c}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
