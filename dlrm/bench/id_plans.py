"""What reusing the coded input all-to-all's sorted ids saves the output all-to-all's dedup by id.

One rank of 2, table-wise, per iteration (docs/compression.md's synthetic setup: 26 Criteo-like
Zipf tables, 1,024 samples per rank, dim 64): its 13 tables' forward rows to the peer and the
peer's gradients back, the peer's 13 tables' rows from it and our gradients to it, each side with
its ids taken from a KJT as the output dist takes them. Timed with the input codec's plans on the
KJTs (``reused``) and without (``sorted``), alternating, in one process::

    OMP_NUM_THREADS=1 python -m dlrm.bench.id_plans [--iterations 50] [--rows 1024] [--device-path]

``plans``: the id plans alone (region ids, dedup plans, duplicate-id first rows of both sides);
``codec``: the whole codec work of both directions and sides (encode, decode, duplicate-id sums).
``--device-path``: the device code (torch sorts, fixed-length coder) on CPU tensors: the codec on
the device backend (``backend="device"``) and the id plans without numpy's sorts.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dlrm.bench.criteo_like import criteo_like_batch
from dlrm.embedding_comm.ids import Region, attach_plans, first_rows, keep_first_duplicates, pending_ids, sum_duplicates
from dlrm_compression import dedup
from dlrm_compression.format import settle
from dlrm_compression.ids_codec import IdsCodec
from dlrm_compression.lossy import LossyCodec

TABLES, DIM, BOUND = 26, 64, 1e-3


def _side(rows: int, seed: int, keys: slice) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor, torch.Tensor, Region]:
    """A KJT of ``keys`` (one id per bag) with the ids codec's plans, the same without, the rows of
    those tables, and the region of every key's bags."""
    batch = criteo_like_batch(rows=rows, tables=TABLES, dim=DIM, seed=seed)
    names = sorted(batch)[keys]
    values = torch.cat([batch[n]["ids"] for n in names])
    lengths = torch.ones(len(names) * rows, dtype=torch.int32)
    planned, plain = (KeyedJaggedTensor(keys=names, values=values, lengths=lengths, stride=rows) for _ in range(2))
    payload = IdsCodec().encode(lengths, values, [rows] * len(names))[0]
    plans = IdsCodec().decode(payload).plan  # as the receiver gets them
    assert plans is not None
    attach_plans(planned, plans, 0, [0] * len(names))
    x = torch.cat([batch[n]["values"] for n in names], 1)
    return planned, plain, x, Region(0, len(names), 0, rows)


def _ids(kjt: KeyedJaggedTensor, r: Region) -> torch.Tensor:
    ids = pending_ids([(kjt, [r])]).candidates[0][0]
    assert ids is not None
    return ids


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=50)
    p.add_argument("--rows", type=int, default=1024, help="samples per rank")
    p.add_argument("--device-path", action="store_true", help="the device code paths on CPU tensors")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    half = slice(0, TABLES // 2), slice(TABLES // 2, TABLES)
    own = _side(a.rows, 1, half[0])  # our tables, the peer's samples (we send rows, get gradients)
    peer = _side(a.rows, 2, half[1])  # the peer's tables, our samples (we get rows, send gradients)
    widths = [DIM] * (TABLES // 2)
    codec = LossyCodec(entropy="auto").with_backend("device" if a.device_path else "auto")
    numpy = codec.backend_for(own[2].device).numpy_sorts  # the id plans' sorts, as the codec's
    grad = torch.randn(a.rows, sum(widths)) * 1e-3
    enc = codec.encode_deferred if a.device_path else codec.encode
    # what the peer sends us: its tables' rows for our samples, our tables' gradients
    from_peer = settle([enc(peer[2], [BOUND] * len(widths), _ids(peer[1], peer[3]))])[0]
    grads_from_peer = settle([enc(grad, [BOUND] * len(widths), _ids(own[1], own[3]))])[0]
    assert from_peer is not None and grads_from_peer is not None

    def plans(which: int) -> None:
        for kjt, r in ((own[which], own[3]), (peer[which], peer[3])):
            ids = _ids(kjt, r)
            dedup.plan_by_ids(ids, numpy=numpy)
            dedup.inverse_from_ids(ids, numpy=numpy)
            first_rows(ids)

    def codec_work(which: int) -> None:
        ids_own, ids_peer = _ids(own[which], own[3]), _ids(peer[which], peer[3])
        settle([enc(own[2], [BOUND] * len(widths), ids_own)])  # forward send
        codec.decode(from_peer, ids_peer)  # forward receive
        settle([enc(sum_duplicates(grad, ids_peer, widths), [BOUND] * len(widths), ids_peer)])  # backward send
        keep_first_duplicates(codec.decode(grads_from_peer, ids_own), ids_own, widths)  # backward receive

    rows = []
    for name, fn in (("plans", plans), ("codec", codec_work)):
        times: dict[int, list[float]] = {0: [], 1: []}
        for i in range(a.iterations + 3):
            for which in (0, 1) if i % 2 else (1, 0):
                t0 = time.perf_counter()
                fn(which)
                if i >= 3:  # warm-up
                    times[which].append(1e3 * (time.perf_counter() - t0))
        reused, sorted_ = statistics.median(times[0]), statistics.median(times[1])
        rows.append((name, sorted_, reused))
    path = "device code on CPU" if a.device_path else "host (numpy) code"
    print(f"ms per iteration, one rank of 2, {a.rows} samples per rank, {TABLES} tables x dim {DIM}; {path}")
    print("| work | sorted (ms) | reused (ms) | saved | sorted / reused |")
    print("|---|---:|---:|---:|---:|")
    for name, s, r in rows:
        print(f"| {name} | {s:.2f} | {r:.2f} | {s - r:.2f} | {s / r:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
