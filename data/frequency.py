"""How often each id of a categorical feature occurs: the hottest ids exactly, the tail as a summary.

Written to ``meta.json`` under ``frequency`` by the preprocessor and the synthetic generator (and
estimated by the trainer from its first batches when a dataset has none), read by the placement
cost model (expected distinct ids per batch) and by hot-row replication (which ids to replicate).
Ids are table rows (after the preprocessor's mapping), so they index the embedding tables directly.

Schema (one entry per categorical feature, in ``SPARSE_NAMES`` order)::

    "frequency": {"source": "counted" | "synthetic" | "batches", "top_n": N,
                  "features": [{"lookups": L, "distinct": D, "singletons": S, "zipf_s": s,
                                "top_ids": [...], "top_counts": [...]}, ...]}

``lookups`` counts every row of the feature (missing values included: they look up row 0 too),
``top_ids``/``top_counts`` are the ``min(N, D)`` most frequent ids, most frequent first (ties by
id), and ``zipf_s`` is the exponent of a power law count ~ rank^-s fitted to all the counts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

FREQUENCY_KEY = "frequency"
DEFAULT_TOP_N = 1024
SOURCES = ("counted", "synthetic", "batches")


def seen_probability(p: np.ndarray, lookups: float) -> np.ndarray:
    """Per id of probability ``p``: the chance it occurs among ``lookups`` independent draws,
    1 - (1 - p)^lookups (summed: the expected number of distinct ids), stable for tiny p."""
    return -np.expm1(lookups * np.log1p(-np.minimum(p, 1.0 - 1e-12)))


@dataclass(frozen=True)
class FeatureFrequency:
    """One feature's id frequencies: the top ids exactly, the tail by its size and power law."""

    lookups: int
    distinct: int
    singletons: int
    zipf_s: float
    top_ids: np.ndarray  # int64, most frequent first
    top_counts: np.ndarray  # int64, non-increasing

    @classmethod
    def from_counts(cls, ids: np.ndarray, counts: np.ndarray, top_n: int = DEFAULT_TOP_N) -> FeatureFrequency:
        """Summarise distinct ``ids`` seen ``counts`` times each (ids with count 0 are ignored)."""
        ids, counts = np.asarray(ids, dtype=np.int64), np.asarray(counts, dtype=np.int64)
        seen = counts > 0
        ids, counts = ids[seen], counts[seen]
        order = np.lexsort((ids, -counts))  # by count descending, then id
        ids, counts = ids[order], counts[order]
        return cls(
            lookups=int(counts.sum()),
            distinct=len(ids),
            singletons=int((counts == 1).sum()),
            zipf_s=fit_zipf(counts),
            top_ids=ids[:top_n].copy(),
            top_counts=counts[:top_n].copy(),
        )

    @classmethod
    def from_ids(cls, ids: np.ndarray, top_n: int = DEFAULT_TOP_N) -> FeatureFrequency:
        """Summarise a sample of lookups (one id per lookup)."""
        uniq, counts = np.unique(np.asarray(ids, dtype=np.int64), return_counts=True)
        return cls.from_counts(uniq, counts, top_n)

    def top_probabilities(self) -> np.ndarray:
        """Probability of each top id per lookup."""
        return self.top_counts / max(self.lookups, 1)

    def probabilities(self) -> np.ndarray:
        """Per-lookup probability of every distinct id, most frequent first: the top ids as counted,
        the tail (ids past the top) as a power law with exponent ``zipf_s`` holding the rest of the mass."""
        top = self.top_probabilities()
        tail_n = self.distinct - len(top)
        tail_mass = max(1.0 - float(top.sum()), 0.0)
        if tail_n <= 0 or tail_mass == 0.0:
            return top
        weights = np.arange(len(top) + 1, self.distinct + 1, dtype=np.float64) ** -self.zipf_s
        return np.concatenate([top, weights * (tail_mass / weights.sum())])

    def expected_distinct(self, lookups: float, skip_top: int = 0) -> float:
        """E[distinct ids] among ``lookups`` independent draws: sum_i 1 - (1 - p_i)^lookups, over ids
        past the ``skip_top`` hottest (those served elsewhere, e.g. replicated)."""
        return float(seen_probability(self.probabilities()[skip_top:], lookups).sum())

    def to_json(self) -> dict[str, Any]:
        return {
            "lookups": self.lookups,
            "distinct": self.distinct,
            "singletons": self.singletons,
            "zipf_s": round(self.zipf_s, 4),
            "top_ids": self.top_ids.tolist(),
            "top_counts": self.top_counts.tolist(),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> FeatureFrequency:
        top_ids, top_counts = np.asarray(d["top_ids"], np.int64), np.asarray(d["top_counts"], np.int64)
        if len(top_ids) != len(top_counts) or np.any(np.diff(top_counts) > 0):
            raise ValueError("top_ids and top_counts must have one length and counts must not increase")
        return cls(int(d["lookups"]), int(d["distinct"]), int(d["singletons"]), float(d["zipf_s"]), top_ids, top_counts)


def fit_zipf(sorted_counts: np.ndarray) -> float:
    """Least-squares slope of log(count) against log(rank) over log-spaced ranks (so the long tail
    does not outvote the head); 0.0 for a flat or too-short distribution."""
    counts = np.asarray(sorted_counts, dtype=np.float64)
    if len(counts) < 3 or counts[0] <= counts[-1]:
        return 0.0
    ranks = np.unique(np.geomspace(1, len(counts), num=min(64, len(counts))).astype(np.int64))
    x, y = np.log(ranks), np.log(counts[ranks - 1])
    slope = np.polyfit(x, y, 1)[0]
    return float(max(-slope, 0.0))


def estimate_from_batches(batches: Iterable[Any], top_n: int = DEFAULT_TOP_N) -> tuple[list[FeatureFrequency], int]:
    """Per-feature frequencies of the ids in ``batches`` (TorchRec ``Batch``es, one KJT key per
    feature), for a dataset whose meta.json records none; returns them and the rows read."""
    per_key: dict[str, list[np.ndarray]] = {}
    rows = 0
    for batch in batches:
        kjt = batch.sparse_features
        rows += kjt.stride()
        for key, jt in kjt.to_dict().items():
            per_key.setdefault(key, []).append(jt.values().numpy())
    if not per_key:
        raise ValueError("no batches to estimate id frequencies from")
    return [FeatureFrequency.from_ids(np.concatenate(v), top_n) for v in per_key.values()], rows


def frequency_meta(features: list[FeatureFrequency], source: str, top_n: int) -> dict[str, Any]:
    """The ``meta.json`` entry for per-feature frequencies."""
    if source not in SOURCES:
        raise ValueError(f"frequency source must be one of {SOURCES} (got {source!r})")
    return {"source": source, "top_n": top_n, "features": [f.to_json() for f in features]}


def read_frequency(meta: Mapping[str, Any]) -> list[FeatureFrequency] | None:
    """Per-feature frequencies of a dataset's meta.json, or None when it records none."""
    entry = meta.get(FREQUENCY_KEY)
    if entry is None:
        return None
    try:
        return [FeatureFrequency.from_json(f) for f in entry["features"]]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"meta.json {FREQUENCY_KEY!r} is malformed: {e}") from e
