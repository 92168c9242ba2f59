"""Per-feature, per-direction statistics of the compressed all-to-alls, as TensorBoard-ready keys.

Each compressed dist owns a :class:`CommStats` of plain sums and maxima; nothing is communicated
while training. :mod:`dlrm.telemetry.comm_stats` merges the dists of a model, on one rank or all of them;
:func:`derive` turns merged sums into the flat ``comm/...`` keys, whose names :func:`key` builds.

What is measured, per direction (``forward`` = pooled embeddings, ``backward`` = gradients):

* ``raw_bytes``: fp32 bytes of the chunks sent to other ranks (a rank's own chunk never travels);
  exact, also per feature.
* ``wire_bytes``: payload bytes actually sent plus the 8-byte size words of the size exchange;
  ``ratio`` = raw / wire.
* per-feature ``ratio/<f>``: sampled - every ``sample_every`` training iterations the sender also
  encodes each block of one chunk alone and records its size (packed payloads mix the tables).
* ``max_abs_error`` (and ``/<f>``): sampled on the sender - on the same iterations it decodes the
  payload of one destination and compares it with what it encoded (the receiver's own decode is
  not compared: it has no original). ``max_error_over_bound`` is the worst error/bound seen (must
  stay <= 1 for bounded codecs).
* ``codec_ms`` (encode + decode + duplicate-id sums) and ``comm_ms`` (size exchange + waiting for
  the data), summed over the window, with ``calls`` the number of collectives; ``sample_ms`` is the
  cost of the sampling above, kept out of ``codec_ms``. Host clocks: on CUDA they include the
  host syncs the size exchange forces and miss kernel time still in flight.

The input (KJT) all-to-all (``input``, :mod:`dlrm.embedding_comm.embeddingbag`) records
``wire_bytes`` and ``calls``; coded (``compression.input=ids``, :mod:`dlrm.embedding_comm.input_dist`)
also ``raw_bytes`` (what TorchRec's would have sent) and ``codec_ms``.

``ids/plans`` counts the forward's chunks (both sides) whose ids the dedup may plan, and
``ids/plans_reused`` those that take the coded input all-to-all's plan of the same batch instead
of sorting their ids again (:mod:`dlrm.embedding_comm.ids`).

The dense gradient all-reduce (``dense``, :mod:`dlrm.dense_comm.stats`) records the same ``raw_bytes``,
``wire_bytes``, ``codec_ms``, ``comm_ms`` and ``calls``, and under DCT ``kept``/``numel`` (whose
quotient :func:`derive` writes as ``comm/dense/keep``), ``threshold`` and ``residual_norm``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

DIRECTIONS = ("forward", "backward")
CHANNELS = (*DIRECTIONS, "dense")  # the all-to-alls' two directions, and the dense all-reduce


class CommStats:
    """Sums and maxima keyed ``direction/name[/feature]``, for the current window and the whole run."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.maxes: dict[str, float] = {}
        self.run_sums: dict[str, float] = defaultdict(float)  # never reset: run totals
        self.run_maxes: dict[str, float] = {}

    def add(self, key: str, value: float) -> None:
        self.sums[key] += value
        self.run_sums[key] += value

    def maximum(self, key: str, value: float) -> None:
        for maxes in (self.maxes, self.run_maxes):
            if key not in maxes or value > maxes[key] or value != value:  # keep NaN visible
                maxes[key] = value

    def reset(self) -> None:
        """Start a new window (run totals are kept)."""
        self.sums.clear()
        self.maxes.clear()

    def state(self, run: bool = False) -> tuple[dict[str, float], dict[str, float]]:
        return (dict(self.run_sums), dict(self.run_maxes)) if run else (dict(self.sums), dict(self.maxes))


def merge(states: Iterable[tuple[Mapping[str, float], Mapping[str, float]]]) -> tuple[dict, dict]:
    """Sum the sums and take the max of the maxima of several :meth:`CommStats.state` results."""
    sums: dict[str, float] = defaultdict(float)
    maxes: dict[str, float] = {}
    for s, m in states:
        for k, v in s.items():
            sums[k] += v
        for k, v in m.items():
            if k not in maxes or v > maxes[k] or v != v:
                maxes[k] = v
    return dict(sums), maxes


def derive(sums: Mapping[str, float], maxes: Mapping[str, float]) -> dict[str, float]:
    """Flat ``comm/...`` keys: totals, ratios, per-feature figures, and ``comm/max_abs_error_seen``."""
    out: dict[str, float] = {}
    for k, v in sums.items():
        if "/sampled_" not in k:
            out[f"comm/{k}"] = float(v)
    for k, v in maxes.items():
        out[f"comm/{k}"] = float(v)
    for d in CHANNELS:
        raw, wire = sums.get(f"{d}/raw_bytes", 0.0), sums.get(f"{d}/wire_bytes", 0.0)
        if wire > 0:
            out[f"comm/{d}/ratio"] = raw / wire
        prefix = f"{d}/sampled_raw_bytes/"
        for k, sraw in sums.items():
            if k.startswith(prefix):
                feature = k[len(prefix) :]
                swire = sums.get(f"{d}/sampled_wire_bytes/{feature}", 0.0)
                if swire > 0:
                    out[f"comm/{d}/ratio/{feature}"] = sraw / swire
    out.update(_cache_probe(sums))
    if sums.get("dense/numel", 0.0) > 0:
        out["comm/dense/keep"] = sums.get("dense/kept", 0.0) / sums["dense/numel"]
    errs = [maxes[f"{d}/max_abs_error"] for d in DIRECTIONS if f"{d}/max_abs_error" in maxes]
    if errs:
        out["comm/max_abs_error_seen"] = max(errs)
    return out


def _cache_probe(sums: Mapping[str, float]) -> dict[str, float]:
    """Shares of a batch's unique forward rows (per destination) whose id is held and that were
    hits, and the byte gain: for the built row cache (``comm/forward/cache_hit``, ``cache_held``:
    :mod:`dlrm.embedding_comm.forward_cache`) and per scheme of the probe (``cache_probe_*``,
    ``cache_delta_probe_*``: :mod:`dlrm.embedding_comm.cache_probe`)."""
    out: dict[str, float] = {}
    for scheme in ("cache", "cache_probe", "cache_delta_probe"):
        prefix = f"forward/{scheme}/unique_rows"
        for k, unique in sums.items():
            if k.startswith(prefix) and unique > 0:
                tail = k[len(prefix) :]  # "" or "/<feature>"
                out[f"comm/forward/{scheme}_hit{tail}"] = sums.get(f"forward/{scheme}/hit_rows{tail}", 0.0) / unique
                out[f"comm/forward/{scheme}_held{tail}"] = sums.get(f"forward/{scheme}/held_rows{tail}", 0.0) / unique
        cached = sums.get(f"forward/{scheme}/cached_bytes", 0.0)
        if cached > 0:
            out[f"comm/forward/{scheme}_gain"] = sums.get(f"forward/{scheme}/payload_bytes", 0.0) / cached
    return out


def key(direction: str, name: str, feature: str | None = None) -> str:
    """A flat statistics key as :func:`derive` writes it, e.g. ``comm/forward/max_abs_error/cat_0``."""
    if direction not in CHANNELS:
        raise ValueError(f"direction must be one of {CHANNELS}, got {direction!r}")
    return f"comm/{direction}/{name}" + (f"/{feature}" if feature is not None else "")


def per_feature(stats: Mapping[str, float], direction: str, name: str) -> dict[str, float]:
    """``{feature: value}`` of one per-feature statistic (e.g. ``max_abs_error``) in :func:`derive` output."""
    prefix = key(direction, name) + "/"
    return {k[len(prefix) :]: float(v) for k, v in stats.items() if k.startswith(prefix)}
