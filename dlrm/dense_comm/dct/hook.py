"""The DCT-DP hook of one DDP bucket (Gupta et al., KDD'21).

``f = g + residual``; every ``refresh_every`` iterations the threshold of each parameter becomes
the k-th largest of its ``|f|`` (k = keep x numel; parameters under ``min_numel`` travel whole);
every iteration the entries with ``|f| >= threshold`` travel
(:class:`compression.sparse.ThresholdCodec`: positions as delta-coded indices or a bitmap,
whichever is smaller; values exact, fp16/bf16 or lossy), summed over the ranks by the bucket's
aggregation (:mod:`.aggregation`: an all-gather, or a reduce-scatter by segment owners) and
divided by the world size like DDP's average; ``residual = f - what was sent, as decoded``.
Non-finite entries always travel, exactly (as in the all-to-alls): they leave no residual and do
not set the lossy values' bound.

Thresholds stay 0-d tensors and every payload is coded and decoded on the gradients' device;
each phase makes one host read (:mod:`.aggregation`), and the checks of the payloads a bucket
sums are read before its future completes with values: a damaged payload raises from the
bucket's future on the ranks that received it, naming the ranks, the bucket and the iteration;
the sender stops at its next collective's timeout (the process group's).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from dlrm.dense_comm.dct.aggregation import AGGREGATIONS
from dlrm.dense_comm.dct.state import DCTState

Future = torch.futures.Future


def dct_hook(state: DCTState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """DCT of one bucket of at least ``min_numel`` entries: its selection, summed over the ranks."""
    t0 = time.perf_counter()
    assert state.pg is not None, "DCTState.prepare() was not called"
    acc = state.accumulated(bucket)
    mags = [None] * len(acc.numels) if acc.mags is None else acc.mags.split(acc.numels)
    pieces = zip(acc.names, acc.f.split(acc.numels), mags, strict=True)
    thresholds = [state.threshold(name, piece, m) for name, piece, m in pieces]
    aggregate = AGGREGATIONS[state.aggregation(acc.numels, state.pg.size())]
    return aggregate(state, acc, thresholds, t0)
