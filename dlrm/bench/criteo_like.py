"""Criteo-like pooled-embedding batches for the codec benchmarks and tests: what a rank sends per table.

Criteo features are single-hot, so a pooled row is one table row and a repeated id repeats the
row bit for bit. Ids of table t follow a Zipf(a_t) law truncated to the table's cardinality,
a_t ~ U(1.1, 1.3), sampled exactly by rejection; rows are N(0, sigma) (or the DLRM default
U(-1/sqrt(n), 1/sqrt(n))) and only the referenced rows are drawn.
"""

from __future__ import annotations

import numpy as np
import torch

# Criteo Kaggle (Display Advertising Challenge) cardinalities of the 26 categorical features,
# as used by facebookresearch/dlrm.
KAGGLE_CARDINALITIES = [
    1460,
    583,
    10131227,
    2202608,
    305,
    24,
    12517,
    633,
    3,
    93145,
    5683,
    8351593,
    3194,
    27,
    14992,
    5461306,
    10,
    5652,
    2173,
    4,
    7046547,
    18,
    15,
    286181,
    105,
    142572,
]


def zipf_ids(rng: np.random.Generator, a: float, n: int, size: int) -> np.ndarray:
    """``size`` draws of Zipf(a) truncated to [1, n] (rejection keeps the law exact)."""
    out = np.empty(size, dtype=np.int64)
    todo = np.arange(size)
    while todo.size:  # each round redraws only the rejected positions
        s = rng.zipf(a, todo.size)
        ok = s <= n
        out[todo[ok]] = s[ok]
        todo = todo[~ok]
    return out


def criteo_like_batch(
    rows: int = 4096,
    tables: int = 26,
    dim: int = 64,
    seed: int = 0,
    nodup: bool = False,
    init: str = "normal",
    sigma: float = 0.01,
) -> dict[str, dict[str, torch.Tensor]]:
    """{table name: {"values": float32 [rows, dim], "ids": int64 [rows]}} for one batch."""
    if init not in ("normal", "uniform"):
        raise ValueError(f"init must be 'normal' or 'uniform', got {init!r}")
    rng = np.random.default_rng(seed)
    out = {}
    for t in range(tables):
        n = KAGGLE_CARDINALITIES[t % len(KAGGLE_CARDINALITIES)]
        a = rng.uniform(1.1, 1.3)
        ids = rng.integers(0, 10**7, rows) if nodup else zipf_ids(rng, a, n, rows)
        uniq, inverse = np.unique(ids, return_inverse=True)
        if init == "normal":
            table = rng.standard_normal((len(uniq), dim)).astype(np.float32) * np.float32(sigma)
        else:
            lim = 1.0 / np.sqrt(10**7 if nodup else n)
            table = rng.uniform(-lim, lim, (len(uniq), dim)).astype(np.float32)
        out[f"t{t:02d}"] = {"values": torch.from_numpy(table[inverse]), "ids": torch.from_numpy(ids)}
    return out
