"""Codec benchmark: ratio, max error, bound held and MB/s of every codec on one embedding batch.

    python -m dlrm.bench.codec [--input FILE.pt] [--nodup] [--repeats 5] [--threads 1] [--json PATH]

One payload per table (as the all-to-all sends per table and destination), at absolute bounds
1e-2, 1e-3, 1e-4 and at the same numbers relative to each table's value range. Throughput is
input float bytes / median time over ``--repeats`` runs (after one warm-up); ``--clock cpu``
counts this process's CPU time instead of wall time, for machines shared with other work.
Decompression is timed twice: into fresh tensors, and into the caller's output buffers
(``decode(..., out=)``, reused across repeats, as the all-to-all decodes into its output; on CPU a
fresh 1 MB tensor per table costs page faults that can exceed the decoding itself).
``--input`` takes a ``torch.save``d dict: table name -> {"values": float [rows, dim], "ids":
optional int [rows]}; without it a Criteo-like batch is generated (:mod:`dlrm.bench.criteo_like`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import torch

import dlrm_compression as compression
from dlrm.bench.criteo_like import criteo_like_batch

BOUNDS = [1e-2, 1e-3, 1e-4]


@dataclass
class Variant:
    """One codec configuration to benchmark."""

    label: str
    codec: str
    params: dict
    use_ids: bool = False


VARIANTS = [
    Variant("lossy+ids zstd", "lossy", {"entropy": True}, True),
    Variant("lossy+ids fixed", "lossy", {"entropy": False}, True),
    Variant("lossy zstd (index sent)", "lossy", {"entropy": True}),
    Variant("lossy fixed (index sent)", "lossy", {"entropy": False}),
    Variant("none", "none", {}),
    Variant("fp16", "fp16", {}),
    Variant("bf16", "bf16", {}),
    Variant("int8 (row-wise)", "int8", {}),
    Variant("fp8 (hfp8)", "fp8", {}),
    Variant("mx4", "mx4", {}),
]


@dataclass
class Row:
    """One line of the result table (also one JSON record)."""

    codec: str
    mode: str  # "abs", "rel" or "-" for the unbounded baselines
    eb: float | None
    ratio: float
    max_abs_error: float
    bound_held: bool | None  # None: the codec promises no bound
    compress_MBps: float
    decompress_MBps: float
    decompress_into_MBps: float  # decode(..., out=) into reused output buffers
    bytes_in: int
    bytes_out: int
    max_error_over_bound: float | None = None


def load_tables(
    path: str | None, rows: int, tables: int, dim: int, nodup: bool, seed: int
) -> dict[str, dict[str, torch.Tensor]]:
    """The benchmark batch: ``path`` if given (checked), else a generated Criteo-like batch."""
    if path is None:
        return criteo_like_batch(rows=rows, tables=tables, dim=dim, seed=seed, nodup=nodup)
    data = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{path}: expected a non-empty dict of table name -> {{'values', 'ids'}}")
    for name, t in data.items():
        if not isinstance(t, dict) or "values" not in t:
            raise ValueError(f"{path}: table {name!r} has no 'values' tensor")
        v = t["values"]
        if not isinstance(v, torch.Tensor) or v.dim() != 2 or not v.dtype.is_floating_point:
            raise ValueError(f"{path}: table {name!r} 'values' must be a 2-D float tensor")
        ids = t.get("ids")
        if ids is not None and (not isinstance(ids, torch.Tensor) or tuple(ids.shape) != (v.shape[0],)):
            raise ValueError(f"{path}: table {name!r} 'ids' must be an int tensor of shape [{v.shape[0]}]")
    return data


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = time.perf_counter


_T = TypeVar("_T")


def _timed(fn: Callable[[], _T], repeats: int) -> tuple[float, _T]:
    """Median seconds of ``fn()`` over ``repeats`` runs after a warm-up, and its last result."""
    out = fn()
    times = []
    for _ in range(repeats):
        t0 = _clock()
        out = fn()
        times.append(_clock() - t0)
    return max(statistics.median(times), 1e-9), out


def run_variant(v: Variant, tables: dict, bounds: Sequence[list[float] | torch.Tensor] | None, repeats: int) -> tuple:
    """(seconds to encode all tables, to decode into fresh tensors, to decode into reused
    buffers, bytes out, max abs error per table)."""
    codec = compression.get_codec(v.codec, **v.params)
    names = list(tables)
    vals = [tables[n]["values"] for n in names]
    ids = [tables[n].get("ids") if v.use_ids else None for n in names]
    ebs = bounds if bounds is not None else [None] * len(names)
    t_enc, payloads = _timed(lambda: [codec.encode(x, e, i) for x, e, i in zip(vals, ebs, ids, strict=True)], repeats)
    t_dec, outs = _timed(lambda: [codec.decode(p, i) for p, i in zip(payloads, ids, strict=True)], repeats)
    bufs = [torch.empty_like(x) for x in vals]
    t_into, _ = _timed(
        lambda: [codec.decode(p, i, out=b) for p, i, b in zip(payloads, ids, bufs, strict=True)], repeats
    )
    if any(
        not torch.equal(b.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8))
        for b, y in zip(bufs, outs, strict=True)
    ):
        raise AssertionError(f"{v.label}: decoding into a buffer differs from decoding into a fresh tensor")
    errs = []
    for x, y in zip(vals, outs, strict=True):
        fin = torch.isfinite(x)
        errs.append((y.double()[fin] - x.double()[fin]).abs().max().item() if fin.any() else 0.0)
    return t_enc, t_dec, t_into, sum(int(p.numel()) for p in payloads), errs


def benchmark(
    tables: dict, repeats: int, variants: list[Variant] = VARIANTS, bound_values: list[float] = BOUNDS, log=print
) -> list[Row]:
    """Every variant at every bound (absolute and relative); baselines once, checked per bound."""
    bytes_in = sum(t["values"].numel() * t["values"].element_size() for t in tables.values())
    have_ids = all(t.get("ids") is not None for t in tables.values())
    rows: list[Row] = []
    for v in variants:
        if v.use_ids and not have_ids:
            log(f"skip {v.label}: not every table has ids")
            continue
        try:
            codec = compression.get_codec(v.codec, **v.params)
        except ValueError as e:
            log(f"skip {v.label}: {e}")
            continue
        if not codec.bounded:
            try:
                t_enc, t_dec, t_into, out, errs = run_variant(v, tables, None, repeats)
            except NotImplementedError as e:
                log(f"skip {v.label}: {e}")
                continue
            rows.append(
                Row(
                    v.label,
                    "-",
                    None,
                    bytes_in / out,
                    max(errs),
                    None,
                    bytes_in / t_enc / 1e6,
                    bytes_in / t_dec / 1e6,
                    bytes_in / t_into / 1e6,
                    bytes_in,
                    out,
                )
            )
            continue
        for mode in ("abs", "rel"):
            for eb in bound_values:
                # rel: the bounds as the trainer hands them over, a tensor on the values' device
                per_table: list[list[float] | torch.Tensor] = [
                    [eb] if mode == "abs" else compression.relative_to_absolute(t["values"], eb)
                    for t in tables.values()
                ]
                t_enc, t_dec, t_into, out, errs = run_variant(v, tables, per_table, repeats)
                firsts = [float(b[0]) for b in per_table]
                held = all(err <= b for err, b in zip(errs, firsts, strict=True))
                worst = max(
                    (err / b if b > 0 else (0.0 if err == 0 else math.inf)) for err, b in zip(errs, firsts, strict=True)
                )
                rows.append(
                    Row(
                        v.label,
                        mode,
                        eb,
                        bytes_in / out,
                        max(errs),
                        held,
                        bytes_in / t_enc / 1e6,
                        bytes_in / t_dec / 1e6,
                        bytes_in / t_into / 1e6,
                        bytes_in,
                        out,
                        worst,
                    )
                )
    return rows


def format_table(rows: list[Row]) -> str:
    """The results as a Markdown table."""
    lines = [
        "| codec | mode | eb | ratio | max abs err | bound held | compress MB/s | decompress MB/s "
        "| decompress into buffer MB/s |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        held = "n/a" if r.bound_held is None else ("yes" if r.bound_held else "**NO**")
        eb = "-" if r.eb is None else f"{r.eb:g}"
        lines.append(
            f"| {r.codec} | {r.mode} | {eb} | {r.ratio:.2f} | {r.max_abs_error:.3g} | {held} "
            f"| {r.compress_MBps:,.0f} | {r.decompress_MBps:,.0f} | {r.decompress_into_MBps:,.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    p = argparse.ArgumentParser(prog="python -m dlrm.bench.codec", description=__doc__.split("\n")[0])
    p.add_argument("--input", help="torch.save'd dict: table -> {'values': [rows, dim], 'ids': [rows]}")
    p.add_argument("--nodup", action="store_true", help="generated ids all distinct (no duplicate rows)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (median)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--json", help="also write the results as JSON here")
    p.add_argument("--rows", type=int, default=4096, help="generated batch: rows per table")
    p.add_argument("--tables", type=int, default=26, help="generated batch: number of tables")
    p.add_argument("--dim", type=int, default=64, help="generated batch: embedding dimension")
    p.add_argument("--seed", type=int, default=0, help="generated batch: random seed")
    p.add_argument("--codecs", help="comma-separated variant labels or codec names to run (default all)")
    p.add_argument("--bounds", help="comma-separated bounds (default 1e-2,1e-3,1e-4)")
    p.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall: elapsed time; cpu: this process's CPU time (steadier on a shared machine)",
    )
    args = p.parse_args(argv)
    if args.repeats < 1 or args.threads < 1:
        p.error("--repeats and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    global _clock
    _clock = CLOCKS[args.clock]
    tables = load_tables(args.input, args.rows, args.tables, args.dim, args.nodup, args.seed)
    variants = VARIANTS
    if args.codecs:
        wanted = {c.strip() for c in args.codecs.split(",")}
        variants = [v for v in VARIANTS if v.label in wanted or v.codec in wanted]
        if not variants:
            p.error(f"--codecs {args.codecs!r} matches none of {[v.label for v in VARIANTS]}")
    bounds = [float(b) for b in args.bounds.split(",")] if args.bounds else BOUNDS
    rows = benchmark(tables, args.repeats, variants, bounds, log=lambda m: print(m, file=sys.stderr))
    n_rows = sum(t["values"].shape[0] for t in tables.values())
    unique = sum(torch.unique(t["ids"]).numel() for t in tables.values() if t.get("ids") is not None)
    config = {
        "input": args.input or "generated",
        "tables": len(tables),
        "rows": n_rows,
        "unique_row_fraction": unique / n_rows if unique else None,
        "nodup": args.nodup,
        "threads": args.threads,
        "repeats": args.repeats,
        "bounds": bounds,
        "clock": args.clock,
        "torch": torch.__version__,
    }
    print(
        f"# {len(tables)} tables, {n_rows} rows, unique fraction {config['unique_row_fraction']}, "
        f"{args.threads} thread(s), median of {args.repeats} ({args.clock} clock)"
    )
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"config": config, "results": [asdict(r) for r in rows]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
