"""Criteo-like synthetic data with a hidden click model, in the preprocessor's on-disk format.

Categorical features take the 26 Kaggle cardinalities of ``criteo_stats.json`` (capped by
``max_cardinality``) and Zipf-distributed ids: exponent drawn from ``zipf_range`` for the big
tables, 1.5-2.5 for tables under 1,000 values so a handful of ids dominate them, as measured on
real samples (notes/criteo.md §4). Missing rates follow the Kaggle head sample. Dense features are
heavy-tailed counts. Labels come from a hidden logistic model: a linear term on the transformed
dense features plus a random effect per id on a dozen features, its intercept calibrated to
``positive_rate``; its own AUC on the generated rows (the ceiling a model can reach) is stored
in meta.json. Rows are generated in chunks seeded by (seed, stem, chunk), so any size streams in
flat memory and a stem's rows do not depend on which other stems are generated.
meta.json's ``frequency`` counts the ids written (all stems), as the preprocessor does.
``write_tsv`` writes the same rows as raw Criteo TSV (hex hashes), to exercise the preprocessor.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from data.frequency import DEFAULT_TOP_N, FeatureFrequency, frequency_meta
from data.layout import (
    DENSE_DTYPE,
    LABEL_DTYPE,
    NUM_DENSE,
    NUM_SPARSE,
    NpyWriter,
    array_path,
    atomic_dataset_dir,
    base_meta,
    sparse_dtype,
    transform_dense,
    write_meta,
)
from data.vocab import ValueCounter

STATS_PATH = Path(__file__).resolve().parent / "criteo_stats.json"
CHUNK_ROWS = 1 << 16
SMALL_TABLE = 1000  # tables with fewer values get steep Zipf exponents (a few ids dominate)
SMALL_ZIPF = (1.5, 2.5)
# Missing rates of the Kaggle head sample (notes/criteo.md §1d), C1..C26 and I1..I13.
SPARSE_MISSING = [
    0,
    0,
    0.03,
    0.03,
    0,
    0.13,
    0,
    0,
    0,
    0,
    0,
    0.03,
    0,
    0,
    0,
    0.03,
    0,
    0,
    0.45,
    0.45,
    0.03,
    0.82,
    0,
    0.03,
    0.45,
    0.45,
]
DENSE_MISSING = [0.45, 0, 0.20, 0.20, 0.05, 0.25, 0.05, 0, 0.05, 0.45, 0.05, 0.78, 0.20]
# Rough medians of the raw counts (sample medians are 0-41, except I5 ~2.8k) and log-spreads.
DENSE_MEDIAN = [1, 3, 7, 5, 2800, 40, 3, 8, 40, 0, 1, 0, 5]
DENSE_SIGMA = [1.2, 1.5, 1.5, 1.0, 1.8, 1.8, 1.5, 1.0, 1.3, 0.8, 1.0, 0.8, 1.3]
EFFECT_FEATURES = [0, 1, 2, 3, 5, 8, 9, 11, 13, 16, 19, 22]  # tables with a per-id random effect
_HIST_BINS, _HIST_LIM = 1 << 16, 16.0  # logit histogram for the streaming hidden-model AUC
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def kaggle_cardinalities() -> list[int]:
    """Published Kaggle cardinalities C1..C26 (each counts the missing value)."""
    return list(json.loads(STATS_PATH.read_text())["kaggle"]["cardinality_dlrm_no_threshold"])


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A good 64-bit mixer (SplitMix64 finaliser); numpy uint64 arithmetic wraps as needed."""
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & _M64
    x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _M64
    x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _M64
    return x ^ (x >> np.uint64(31))


def hash_ids(feature: int, ids: np.ndarray) -> np.ndarray:
    """A bijection of 32-bit ids to 32-bit hash values per feature (what the TSV writer prints)."""
    x = ids.astype(np.uint64) ^ np.uint64((0x9E3779B9 * (feature + 1)) & 0xFFFFFFFF)
    for _ in range(2):  # odd multiplier and xorshift are both invertible modulo 2^32
        x = (x * np.uint64(0x045D9F3B)) & np.uint64(0xFFFFFFFF)
        x ^= x >> np.uint64(16)
    return x


class ZipfSampler:
    """Ranks 1..n with P(k) proportional to k^-s: exact table for the head, continuous tail."""

    def __init__(self, n: int, s: float, head: int = 4096) -> None:
        self.n, self.s = n, s
        self.k = min(n, head)
        self.head_cdf = np.cumsum(np.arange(1, self.k + 1, dtype=np.float64) ** -s)
        self.a, self.b = self.k + 0.5, n + 0.5
        tail = self._integral(self.a, self.b) if n > self.k else 0.0
        self.p_head = self.head_cdf[-1] / (self.head_cdf[-1] + tail)

    def _integral(self, a: float, b: float) -> float:
        return math.log(b / a) if self.s == 1 else (b ** (1 - self.s) - a ** (1 - self.s)) / (1 - self.s)

    def sample(self, u: np.ndarray) -> np.ndarray:
        """Ranks (int64, 1-based) for uniforms ``u`` in [0, 1)."""
        head = u < self.p_head
        ranks = np.empty(u.shape, dtype=np.int64)
        target = u[head] / self.p_head * self.head_cdf[-1]
        ranks[head] = np.minimum(np.searchsorted(self.head_cdf, target, side="right"), self.k - 1) + 1
        if not head.all():
            v = (u[~head] - self.p_head) / (1 - self.p_head)
            if self.s == 1:
                x = self.a * (self.b / self.a) ** v
            else:
                e = 1 - self.s
                x = (self.a**e + v * (self.b**e - self.a**e)) ** (1 / e)
            ranks[~head] = np.clip(np.rint(x), self.k + 1, self.n).astype(np.int64)
        return ranks


@dataclass
class HiddenModel:
    """All parameters of a synthetic data set, fixed by the seed (shared by every stem)."""

    seed: int
    num_embeddings: list[int]
    exponents: list[float]
    multipliers: list[int]  # rank -> id scatter: id = 1 + ((rank-1)*m + c) mod (n-1)
    offsets: list[int]
    dense_weights: np.ndarray
    effect_scales: dict[int, float]
    intercept: float = 0.0
    samplers: list[ZipfSampler] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.samplers = [ZipfSampler(n - 1, s) for n, s in zip(self.num_embeddings, self.exponents, strict=True)]

    @classmethod
    def build(
        cls, seed: int, max_cardinality: int | None, zipf_range: tuple[float, float], positive_rate: float
    ) -> HiddenModel:
        """Draw the model from ``seed`` and calibrate its intercept to ``positive_rate``."""
        if not 0 < positive_rate < 1:
            raise ValueError(f"positive_rate must be in (0, 1), got {positive_rate}")
        if max_cardinality is not None and max_cardinality < 2:
            raise ValueError(f"max_cardinality must be >= 2 (id 0 is reserved), got {max_cardinality}")
        lo, hi = zipf_range
        if not 0 < lo <= hi:
            raise ValueError(f"bad zipf_range {zipf_range}")
        rng = np.random.default_rng([seed, 0x5EED])
        cards = kaggle_cardinalities()
        sizes = [min(c, max_cardinality) if max_cardinality else c for c in cards]
        sizes = [max(s, 2) for s in sizes]
        exps = [float(rng.uniform(*(SMALL_ZIPF if c < SMALL_TABLE else zipf_range))) for c in cards]
        mults, offs = [], []
        for n in sizes:
            m = int(rng.integers(1, 2**31)) | 1
            while math.gcd(m, n - 1) != 1:
                m += 2
            mults.append(m % (n - 1) or 1)
            offs.append(int(rng.integers(0, n - 1)))
        model = cls(
            seed,
            sizes,
            exps,
            mults,
            offs,
            rng.normal(0, 0.3, NUM_DENSE),
            {f: float(rng.uniform(0.3, 0.6)) for f in EFFECT_FEATURES},
        )
        calib = [model.draw_features(np.random.default_rng([seed, 0xCA1, i]), CHUNK_ROWS) for i in range(2)]
        logits = np.concatenate([model.logits(transform_dense(d), ids) for d, ids, _ in calib])
        model.intercept = _calibrate(logits, positive_rate)  # logits so far have intercept 0
        return model

    def draw_features(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Raw dense counts int64 [n,13], ids int64 [n,26] (0 = missing), dense-missing mask."""
        log_med = np.log1p(np.asarray(DENSE_MEDIAN, np.float64))
        dense = np.floor(np.exp(log_med + np.asarray(DENSE_SIGMA) * rng.standard_normal((n, NUM_DENSE))))
        dense = np.maximum(dense.astype(np.int64) - 1, 0)  # counts; many zeros as in the real data
        dense[:, 1] = np.where(rng.random(n) < 0.05, -rng.integers(1, 3, n), dense[:, 1])  # I2 can be -1/-2
        dense_missing = rng.random((n, NUM_DENSE)) < np.asarray(DENSE_MISSING)
        dense[dense_missing] = 0
        ids = np.empty((n, NUM_SPARSE), dtype=np.int64)
        for f, sampler in enumerate(self.samplers):
            rank = sampler.sample(rng.random(n))
            ids[:, f] = 1 + ((rank - 1) * self.multipliers[f] + self.offsets[f]) % (self.num_embeddings[f] - 1)
        ids[rng.random((n, NUM_SPARSE)) < np.asarray(SPARSE_MISSING)] = 0
        return dense, ids, dense_missing

    def logits(self, dense: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Hidden log-odds of a click from transformed dense features (as stored) and ids."""
        med = np.log1p(np.asarray(DENSE_MEDIAN, np.float64))
        z = (dense.astype(np.float64) - med) / np.asarray(DENSE_SIGMA)
        out = self.intercept + z @ self.dense_weights
        for f, scale in self.effect_scales.items():
            key = np.uint64((self.seed * 1000003 + f) & 0xFFFFFFFF) << np.uint64(32)
            u = (_splitmix64(ids[:, f].astype(np.uint64) | key) >> np.uint64(11)).astype(np.float64) * 2.0**-53
            out = out + scale * math.sqrt(12) * (u - 0.5)  # unit-variance uniform effect per id
        return out

    def draw(self, seed_words: list[int], n: int) -> tuple[np.ndarray, ...]:
        """One chunk: raw dense, ids, dense-missing mask, labels uint8, hidden logits."""
        rng = np.random.default_rng(seed_words)
        dense, ids, dmiss = self.draw_features(rng, n)
        logit = self.logits(transform_dense(dense), ids)
        labels = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.uint8)
        return dense, ids, dmiss, labels, logit


def _calibrate(logits: np.ndarray, rate: float) -> float:
    """Intercept b with mean(sigmoid(b + logits)) == rate, by bisection (monotone in b)."""
    lo, hi = -30.0, 30.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if np.mean(1 / (1 + np.exp(-(mid + logits)))) < rate:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _stem_chunks(model: HiddenModel, stem: str, rows: int, chunk_rows: int) -> Iterator[tuple[np.ndarray, ...]]:
    stem_key = zlib.crc32(stem.encode())
    for c, start in enumerate(range(0, rows, chunk_rows)):
        yield model.draw([model.seed, stem_key, c], min(chunk_rows, rows - start))


class _AucAccumulator:
    """Streaming AUC and log loss of the hidden model from a fine histogram of its logits."""

    def __init__(self) -> None:
        self.pos = np.zeros(_HIST_BINS, np.int64)
        self.neg = np.zeros(_HIST_BINS, np.int64)
        self.loss = 0.0
        self.n = 0

    def add(self, logit: np.ndarray, labels: np.ndarray) -> None:
        b = np.clip(((logit + _HIST_LIM) / (2 * _HIST_LIM) * _HIST_BINS).astype(np.int64), 0, _HIST_BINS - 1)
        self.pos += np.bincount(b[labels == 1], minlength=_HIST_BINS)
        self.neg += np.bincount(b[labels == 0], minlength=_HIST_BINS)
        self.loss += float(np.sum(np.logaddexp(0, -logit) * labels + np.logaddexp(0, logit) * (1 - labels)))
        self.n += len(labels)

    def result(self) -> dict[str, float | None]:
        p, n = int(self.pos.sum()), int(self.neg.sum())
        if p == 0 or n == 0:
            return {"auc": None, "logloss": self.loss / max(self.n, 1)}
        below = np.cumsum(self.neg) - self.neg  # negatives in lower bins; ties count one half
        auc = float(np.sum(self.pos * (below + 0.5 * self.neg)) / (p * n))
        return {"auc": round(auc, 5), "logloss": round(self.loss / self.n, 5)}


def generate(
    out_dir: str | Path,
    rows: dict[str, int],
    seed: int = 0,
    max_cardinality: int | None = None,
    zipf_range: tuple[float, float] = (1.05, 1.3),
    positive_rate: float = 0.25,
    overwrite: bool = False,
    chunk_rows: int = CHUNK_ROWS,
    top_ids: int = DEFAULT_TOP_N,
) -> dict[str, Any]:
    """Write a synthetic dataset (stems -> row counts) in the preprocessor's format; return meta."""
    if not rows or any(int(n) < 0 for n in rows.values()):
        raise ValueError(f"rows must map stems to non-negative counts, got {rows}")
    model = HiddenModel.build(seed, max_cardinality, zipf_range, positive_rate)
    ids_dtype = sparse_dtype(model.num_embeddings)
    files, hidden = [], {}
    counters = [ValueCounter() for _ in range(NUM_SPARSE)]
    with atomic_dataset_dir(out_dir, overwrite=overwrite) as tmp:
        for stem, n in rows.items():
            writers = [
                NpyWriter(array_path(tmp, stem, "dense"), n, (NUM_DENSE,), DENSE_DTYPE),
                NpyWriter(array_path(tmp, stem, "sparse"), n, (NUM_SPARSE,), ids_dtype),
                NpyWriter(array_path(tmp, stem, "labels"), n, (), LABEL_DTYPE),
            ]
            acc = _AucAccumulator()
            positives = 0
            for dense, ids, _, labels, logit in _stem_chunks(model, stem, n, chunk_rows):
                writers[0].write(transform_dense(dense))
                writers[1].write(ids)
                for f, counter in enumerate(counters):
                    counter.add(ids[:, f])
                writers[2].write(labels)
                acc.add(logit, labels)
                positives += int(labels.sum())
            for w in writers:
                w.close()
            files.append({"stem": stem, "source": "synthetic", "rows": n, "positives": positives})
            hidden[stem] = acc.result()
        options = {
            "seed": seed,
            "max_cardinality": max_cardinality,
            "zipf_range": list(zipf_range),
            "positive_rate": positive_rate,
            "chunk_rows": chunk_rows,
        }
        meta = base_meta("synthetic", model.num_embeddings, files, options, reserved_rare=False)
        meta["synthetic"] = {
            "zipf_exponents": [round(s, 4) for s in model.exponents],
            "effect_features": sorted(model.effect_scales),
            "intercept": round(model.intercept, 5),
            "hidden_model": hidden,
        }
        freqs = [FeatureFrequency.from_counts(*c.result(), top_n=top_ids) for c in counters]
        meta["frequency"] = frequency_meta(freqs, "synthetic", top_ids)
        write_meta(tmp, meta)
    return meta


def _dec_chars(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ASCII decimal of int64 values, left-aligned in [n, 20] uint8, and lengths."""
    neg = x < 0
    a = np.abs(x)
    ndig = np.ones(x.shape, np.int64)
    for p in range(1, 19):
        ndig += a >= 10**p
    length = ndig + neg
    out = np.zeros((*x.shape, 20), np.uint8)
    for j in range(20):
        pos = ndig - 1 - (j - neg)  # power of ten printed at column j
        digit = (a // np.power(10, np.clip(pos, 0, 18))) % 10
        out[..., j] = np.where((j == 0) & neg, 45, 48 + digit)
    return out, length


def format_tsv(
    labels: np.ndarray, dense: np.ndarray, dense_missing: np.ndarray, hashes: np.ndarray, sparse_missing: np.ndarray
) -> bytes:
    """Raw Criteo TSV lines (label, 13 decimals, 26 8-digit hex hashes; empty = missing)."""
    n = len(labels)
    pieces, lens = [(labels.astype(np.uint8) + 48)[:, None, None]], [np.ones((n, 1), np.int64)]
    d, dl = _dec_chars(dense)
    pieces.append(d)
    lens.append(np.where(dense_missing, 0, dl))
    shifts = np.arange(28, -4, -4, dtype=np.uint64)
    nib = ((hashes.astype(np.uint64)[..., None] >> shifts) & np.uint64(15)).astype(np.uint8)
    pieces.append(np.frombuffer(b"0123456789abcdef", np.uint8)[nib])
    lens.append(np.where(sparse_missing, 0, 8))
    cols, masks = [], []
    for chars, length in zip(pieces, lens, strict=True):
        for f in range(chars.shape[1]):
            cols += [chars[:, f, :], np.full((n, 1), 9, np.uint8)]
            masks += [np.arange(chars.shape[2]) < length[:, f, None], np.ones((n, 1), bool)]
    cols[-1][:] = 10  # the last separator ends the line
    return np.concatenate(cols, axis=1)[np.concatenate(masks, axis=1)].tobytes()


def write_tsv(
    path: str | Path,
    stem: str,
    rows: int,
    seed: int = 0,
    max_cardinality: int | None = None,
    zipf_range: tuple[float, float] = (1.05, 1.3),
    positive_rate: float = 0.25,
    chunk_rows: int = CHUNK_ROWS,
) -> int:
    """Write the rows ``generate`` makes for ``stem`` as raw Criteo TSV; returns positives."""
    model = HiddenModel.build(seed, max_cardinality, zipf_range, positive_rate)
    positives = 0
    with open(path, "wb") as f:
        for dense, ids, dmiss, labels, _ in _stem_chunks(model, stem, rows, chunk_rows):
            hashes = np.stack([hash_ids(k, ids[:, k]) for k in range(NUM_SPARSE)], axis=1)
            f.write(format_tsv(labels, dense, dmiss, hashes, ids == 0))
            positives += int(labels.sum())
    return positives


def _parse_rows(text: str) -> dict[str, int]:
    out = {}
    for item in text.split(","):
        stem, sep, n = item.partition("=")
        if not sep or not stem or not n.strip().isdigit():
            raise argparse.ArgumentTypeError(f"expected stem=rows[,stem=rows...], got {item!r}")
        out[stem.strip()] = int(n)
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m data.synthetic --out DIR --rows train=100000,dev=10000,test=20000 [--tsv]``."""
    p = argparse.ArgumentParser(prog="python -m data.synthetic", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="dataset directory (or, with --tsv, folder of <stem>.tsv)")
    p.add_argument("--rows", required=True, type=_parse_rows, help="stem=rows,... e.g. train=100000,test=20000")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-cardinality", type=int, default=None, help="cap on every table size")
    p.add_argument("--zipf-range", type=float, nargs=2, default=(1.05, 1.3), metavar=("LO", "HI"))
    p.add_argument("--positive-rate", type=float, default=0.25)
    p.add_argument("--tsv", action="store_true", help="write raw Criteo TSV files instead of arrays")
    p.add_argument("--overwrite", action="store_true")
    a = p.parse_args(argv)
    kw = dict(
        seed=a.seed, max_cardinality=a.max_cardinality, zipf_range=tuple(a.zipf_range), positive_rate=a.positive_rate
    )
    try:
        if a.tsv:
            out = Path(a.out)
            out.mkdir(parents=True, exist_ok=True)
            for stem, n in a.rows.items():
                path = out / f"{stem}.tsv"
                if path.exists() and not a.overwrite:
                    raise FileExistsError(f"{path} exists; pass --overwrite")
                pos = write_tsv(path, stem, n, **kw)
                print(f"wrote {path}: {n} rows, {pos} positives")
        else:
            meta = generate(a.out, a.rows, overwrite=a.overwrite, **kw)
            print(
                f"wrote {a.out}: rows {meta['rows']}; table sizes {meta['num_embeddings']}; "
                f"hidden model {meta['synthetic']['hidden_model']}"
            )
    except (ValueError, FileExistsError) as e:
        print(f"python -m data.synthetic: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
