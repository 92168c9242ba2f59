"""``dense_comm=auto``'s calibration: what each option would cost on a real bucket, measured on the
side while the fallback travels (:mod:`dlrm.strategy.controller` collects the samples)."""

from __future__ import annotations

import time

import torch

from dlrm.dense_comm.dct.state import DCTState
from dlrm.performance.network import ring_allreduce_bytes, sparse_aggregation_bytes
from dlrm_compression.sparse import kth_largest_abs

Sample = tuple[str, float, float, float, float]  # option, raw and wire bytes per rank, encode and decode s


def calibrate(dct: DCTState, buf: torch.Tensor, ws: int) -> list[Sample]:
    """Each option on the bucket ``buf`` over ``ws`` ranks: raw and wire bytes per rank as a ring
    all-reduce would send them (DCT: its aggregation's bytes), encode and decode seconds."""
    raw = ring_allreduce_bytes(buf.numel(), ws)
    out: list[Sample] = [("none", raw, raw, 0.0, 0.0)]
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        t0 = time.perf_counter()
        half = buf.to(dtype)
        t1 = time.perf_counter()
        half.to(buf.dtype)
        out.append((name, raw, raw / 2, t1 - t0, time.perf_counter() - t1))
    if buf.numel() >= dct.spec.min_numel:
        t0 = time.perf_counter()
        payload = dct.codec.encode(buf.view(1, -1), None, thresholds=[kth_largest_abs(buf, dct.spec.keep)])
        t1 = time.perf_counter()
        dct.codec.decode(payload)
        t2 = time.perf_counter()
        # decode: every other rank's payload (W - 1 of them) and our own
        header = dct.sizer.payload_size(buf.numel(), [buf.numel()], 0, 1)
        wire = sparse_aggregation_bytes(payload.numel() - header, ws, dct.aggregation([buf.numel()], ws), header)
        out.append(("dct", raw, wire, t1 - t0, (t2 - t1) * ws))
    return out
