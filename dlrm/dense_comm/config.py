"""The `dense_comm` config group: how the data-parallel (dense MLP) gradients are all-reduced.

* ``none``: fp32 all-reduce, stock DDP (no hook);
* ``fp16`` / ``bf16``: cast, all-reduce, cast back (torch's compress hooks);
* ``powersgd``: torch's PowerSGD hook (low-rank, error feedback);
* ``dct``: DCT-DP hard thresholding with error feedback (Gupta et al., KDD'21);
* ``auto``: one of ``none``/``fp16``/``bf16``/``dct``, chosen on the run's own link and
  gradients (:mod:`dlrm.strategy.controller`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dlrm.process.config_checks import check_keys, flag, integer, number, one_of, plain_config
from dlrm_compression.backend import CHOICES as BACKENDS
from dlrm_compression.sparse import VALUE_CODECS

KINDS = ("none", "fp16", "bf16", "powersgd", "dct", "auto")
AGGREGATIONS = ("allgather", "reduce_scatter", "auto")  # how DCT's sparse payloads are summed
AUTO_OPTIONS = ("none", "fp16", "bf16", "dct")  # powersgd needs warm-up iterations: not switched to
_KEYS = {
    "none": set(),
    "fp16": set(),
    "bf16": set(),
    "powersgd": {"rank", "start_iter", "warm_start", "min_compression_rate"},
    "dct": {"keep", "refresh_every", "refresh_warmup", "min_numel", "values", "values_eb", "aggregation"},
}
_KEYS["auto"] = _KEYS["dct"] | {"fallback"}  # auto may choose dct, with these settings
_COMMON = {"name", "bucket_cap_mb", "backend"}


@dataclass(frozen=True)
class DenseCommSpec:
    """A validated `dense_comm` config."""

    name: str = "none"
    bucket_cap_mb: float = 25.0  # DDP's (and TorchRec's) default bucket size
    backend: str = "auto"  # where DCT's stages run (compression.backend: auto | host | device)
    # powersgd
    rank: int = 1
    start_iter: int = 10
    warm_start: bool = True
    min_compression_rate: float = 2.0
    # dct
    keep: float = 0.005  # fraction of each parameter's entries sent, fixed at each threshold refresh
    refresh_every: int = 1000  # iterations between threshold refreshes (published: a few thousand)
    refresh_warmup: bool = True  # also refresh at iterations 1, 2, 4, ... < refresh_every
    min_numel: int = 256  # smaller buckets are all-reduced, smaller parameters sent whole
    values: str = "none"  # codec of the sent values: none (fp32) | fp16 | bf16 | lossy
    values_eb: float = 0.01  # lossy values: bound as a fraction of the largest sent |value|
    # reduce_scatter (default): segments summed by their owners, then their top entries
    # all-gathered (~2 (W-1)/W payloads: the dense ratio holds as W grows); allgather: every
    # rank's payload to every rank ((W-1) payloads received); auto: per bucket, the one with fewer
    # predicted bytes per rank (world size, bucket size, payload headers)
    aggregation: str = "reduce_scatter"
    # auto: the option that travels while the strategy calibrates and measures (and before it)
    fallback: str = "none"

    @property
    def hooked(self) -> bool:
        """Whether a communication hook replaces stock DDP's all-reduce."""
        return self.name != "none"


def parse_dense_comm_cfg(cfg: Mapping[str, Any] | None) -> DenseCommSpec:
    """Validate a `dense_comm` config (dict or DictConfig); errors name the key."""
    cfg = plain_config(cfg) if cfg is not None else {"name": "none"}
    where = "dense_comm"
    if not isinstance(cfg, Mapping):
        raise ValueError(f"{where} config must be a mapping, got {type(cfg).__name__}")
    name = one_of(cfg, "name", where, KINDS, "none")
    check_keys(cfg, _COMMON | _KEYS[name], where)
    d = DenseCommSpec()  # the defaults
    out: dict[str, Any] = {
        "name": name,
        "bucket_cap_mb": number(cfg, "bucket_cap_mb", where, d.bucket_cap_mb, True),
        "backend": one_of(cfg, "backend", where, BACKENDS, d.backend),
    }
    if name == "powersgd":
        out.update(
            rank=integer(cfg, "rank", where, d.rank, 1),
            # torch's PowerSGD with error feedback needs two plain iterations first (DDP's bucket rebuild)
            start_iter=integer(cfg, "start_iter", where, d.start_iter, 2),
            min_compression_rate=number(cfg, "min_compression_rate", where, d.min_compression_rate),
        )
        out["warm_start"] = flag(cfg, "warm_start", where, d.warm_start)
    if name == "auto":
        out["fallback"] = one_of(cfg, "fallback", where, AUTO_OPTIONS, d.fallback)
    if name in ("dct", "auto"):
        keep = number(cfg, "keep", where, d.keep, positive=True)
        if keep > 1:
            raise ValueError(f"{where}.keep is the fraction of entries sent, in (0, 1]; got {keep}")
        values = one_of(cfg, "values", where, VALUE_CODECS, d.values)
        if "values_eb" in cfg and cfg["values_eb"] is not None and values != "lossy":
            raise ValueError(f"{where}.values_eb bounds lossy values only; {where}.values is {values!r}")
        out.update(
            keep=keep,
            refresh_warmup=flag(cfg, "refresh_warmup", where, d.refresh_warmup),
            refresh_every=integer(cfg, "refresh_every", where, d.refresh_every, 1),
            min_numel=integer(cfg, "min_numel", where, d.min_numel, 0),
            values=values,
            values_eb=number(cfg, "values_eb", where, d.values_eb, positive=True),
            aggregation=one_of(cfg, "aggregation", where, AGGREGATIONS, d.aggregation),
        )
    return DenseCommSpec(**out)
