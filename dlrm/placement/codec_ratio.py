"""The codec ratio the placement prices with (``sharding=comm_aware`` and ``placement.hot_rows``):
measured before training by encoding rows like the run's first forward chunk, never looked up by
config name, so that every codec and every user config is priced at what it sends.

Our path: the forward codec on a calibration chunk (:func:`calibrate_ratio`); the gradients'
ratio is not known before training and is taken equal. TorchRec's QComms: its own codec on rows
(:func:`dlrm.embedding_comm.qcomm_ratios`; fixed-rate, no dedup, no size exchange).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from data.frequency import FeatureFrequency
from dlrm.embedding_comm import CompressionSpec, qcomm_ratios
from dlrm.embedding_comm.codec import DirectionCodec
from dlrm.embedding_comm.dist import CompressionRuntime
from dlrm.placement.traffic import Direction


def calibrate_ratio(
    dc: DirectionCodec, features: Sequence[str], freqs: Sequence[FeatureFrequency], batch: int, dim: int, seed: int
) -> float:
    """The codec's ratio (fp32 bytes of the rows it is given / payload) on a chunk like the first
    forward's: each table's ``batch`` ids drawn from its frequencies, rows uniform in +-sqrt(1/n)
    as TorchRec initialises tables, all tables in one payload. No state of the codec changes."""
    rng = np.random.default_rng(seed)
    ids, cols, rows_given = [], [], 0
    for f in freqs:
        p = f.probabilities()
        drawn = rng.choice(len(p), size=batch, p=p / p.sum())
        uniq, inverse = np.unique(drawn, return_inverse=True)
        a = math.sqrt(1.0 / max(f.distinct, 1))
        cols.append(rng.uniform(-a, a, (len(uniq), dim)).astype(np.float32)[inverse])
        ids.append(drawn)
        rows_given += len(uniq) if dc.dedup else batch
    chunk = torch.from_numpy(np.concatenate(cols, axis=1))
    id_t = torch.from_numpy(np.stack(ids, axis=1).astype(np.int64))
    widths = [dim] * len(freqs)
    bounds = dc.bounds(chunk, widths, dc.policy(features, 0))
    thresholds = dc.thresholds(chunk, features, widths, 0, False, "calibrate")
    payload = dc.encode(chunk, widths, bounds, id_t, thresholds, features)
    return rows_given * dim * 4 / max(payload.numel(), 1)


def priced_directions(
    spec: CompressionSpec,
    runtime: CompressionRuntime | None,
    features: Sequence[str],
    freqs: Sequence[FeatureFrequency],
    batch: int,
    dim: int,
    seed: int,
) -> tuple[Direction, Direction]:
    """The forward and backward all-to-alls as :mod:`dlrm.placement.traffic` prices them: dedup,
    framing and the measured ratio (``runtime``: our codecs; None: TorchRec's QComms of ``spec``)."""
    if runtime is None:
        r = qcomm_ratios(spec, dim)
        fwd, bwd = r["forward_ratio"], r["backward_ratio"]
        return Direction(False, fwd, fwd, framed=False), Direction(False, bwd, bwd, framed=False)
    ratio = calibrate_ratio(runtime.forward, features, freqs, batch, dim, seed)
    return Direction(runtime.forward.dedup, ratio, ratio), Direction(runtime.backward.dedup, ratio, ratio)
