"""Codec time of the forward row cache against the cache-free lossy path, per chunk, same run.

    python -m dlrm.bench.cache_speed [--steps 200] [--rows 256] [--tables 13] [--dim 32]
                                     [--cardinality 100000] [--capacity 0] [--repeats 3]

Drives one sender (:class:`dlrm.embedding_comm.forward_cache.ForwardCache` encode) and one receiver (its
decode) over a stream of chunks shaped like the default 2-rank run's forward all-to-all (batch
``rows`` x ``tables`` table blocks of width ``dim``, Zipf ids, rows drifting as training moves
them), and times, per chunk, encode + decode of the cache path and of the cache-free lossy codec
(``DirectionCodec.encode`` + ``codec.decode``) on the same chunks, interleaved so that both see
the same machine load. Prints the medians over ``repeats`` passes, their ratio and the byte ratio.
Not part of ``make test``; wrap it in ``flock`` on a shared machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from dlrm.embedding_comm import fixed_bound
from dlrm.embedding_comm.codec import DirectionCodec
from dlrm.embedding_comm.config import DirectionSpec
from dlrm.embedding_comm.forward_cache import ForwardCache


def chunks(steps: int, rows: int, tables: int, dim: int, cardinality: int, seed: int = 0):
    """(chunk, ids) per step: Zipf(1.1) ids per table, rows drifting by ~0.4 bound per step."""
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    weights = torch.randn(tables, cardinality, dim, generator=g) * 0.05
    for _ in range(steps):
        ids = torch.from_numpy((rng.zipf(1.1, (rows, tables)) - 1) % cardinality).to(torch.int64)
        touched = torch.unique(ids)
        weights[:, touched] += 4e-4 * torch.randn(tables, touched.numel(), dim, generator=g)
        yield torch.cat([weights[k][ids[:, k]] for k in range(tables)], dim=1), ids


def run(steps: int, rows: int, tables: int, dim: int, cardinality: int, capacity: int) -> dict[str, float]:
    """Seconds per chunk (encode + decode) of both paths, and bytes of both, over one stream."""
    dc = DirectionCodec(DirectionSpec("lossy", params={"entropy": True}), "forward", fixed_bound(1e-3))
    widths, feats = [dim] * tables, [f"t{k}" for k in range(tables)]
    sender, receiver = ForwardCache(capacity), ForwardCache(capacity)
    t_cache = t_plain = 0.0
    b_cache = b_plain = 0
    for chunk, ids in chunks(steps, rows, tables, dim, cardinality):
        bounds = [1e-3] * tables
        t0 = time.perf_counter()
        payload, _, _ = sender.encode(dc, chunk, ids, feats, widths, bounds, dst=1)
        receiver.decode(dc, payload, ids, feats, widths, src=0)
        t1 = time.perf_counter()
        plain = dc.encode(chunk, widths, bounds, ids)
        dc.codec.decode(plain, ids)
        t2 = time.perf_counter()
        t_cache, t_plain = t_cache + t1 - t0, t_plain + t2 - t1
        b_cache, b_plain = b_cache + payload.numel(), b_plain + plain.numel()
    return {"cache_s": t_cache / steps, "plain_s": t_plain / steps, "cache_bytes": b_cache, "plain_bytes": b_plain}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--tables", type=int, default=13)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--cardinality", type=int, default=100000)
    p.add_argument("--capacity", type=int, default=0, help="capacity_rows per table (0: unlimited)")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    runs = [run(a.steps, a.rows, a.tables, a.dim, a.cardinality, a.capacity) for _ in range(a.repeats)]
    cache = statistics.median(r["cache_s"] for r in runs) * 1e3
    plain = statistics.median(r["plain_s"] for r in runs) * 1e3
    print(
        f"{a.steps} chunks of {a.rows} rows x {a.tables} tables x dim {a.dim}, capacity_rows={a.capacity}, "
        f"median of {a.repeats}"
    )
    print(f"encode+decode per chunk: cache {cache:.2f} ms, cache-free lossy {plain:.2f} ms, ratio {cache / plain:.2f}x")
    print(f"bytes: cache-free / cache = {runs[0]['plain_bytes'] / runs[0]['cache_bytes']:.2f}x")


if __name__ == "__main__":
    main()
