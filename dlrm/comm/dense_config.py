"""The `dense_comm` config group: how the data-parallel (dense MLP) gradients are all-reduced.

* ``none``: fp32 all-reduce, stock DDP (no hook);
* ``fp16`` / ``bf16``: cast, all-reduce, cast back (torch's compress hooks);
* ``powersgd``: torch's PowerSGD hook (low-rank, error feedback);
* ``dct``: DCT-DP hard thresholding with error feedback (Gupta et al., KDD'21).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from compression.sparse import VALUE_CODECS
from dlrm.config_checks import check_keys, number, plain_config

KINDS = ("none", "fp16", "bf16", "powersgd", "dct")
_KEYS = {
    "none": set(),
    "fp16": set(),
    "bf16": set(),
    "powersgd": {"rank", "start_iter", "warm_start", "min_compression_rate"},
    "dct": {"keep", "refresh_every", "min_numel", "values", "values_eb"},
}
_COMMON = {"name", "bucket_cap_mb"}


@dataclass(frozen=True)
class DenseCommSpec:
    """A validated `dense_comm` config."""

    name: str = "none"
    bucket_cap_mb: float = 25.0  # DDP's (and TorchRec's) default bucket size
    # powersgd
    rank: int = 1
    start_iter: int = 10
    warm_start: bool = True
    min_compression_rate: float = 2.0
    # dct
    keep: float = 0.005  # fraction of each parameter's entries sent, fixed at each threshold refresh
    refresh_every: int = 1000  # iterations between threshold refreshes (published: a few thousand)
    min_numel: int = 256  # smaller buckets are all-reduced uncompressed
    values: str = "none"  # codec of the sent values: none (fp32) | fp16 | bf16 | lossy
    values_eb: float = 0.01  # lossy values: bound as a fraction of the largest sent |value|

    @property
    def hooked(self) -> bool:
        """Whether a communication hook replaces stock DDP's all-reduce."""
        return self.name != "none"


def _int(cfg: Mapping[str, Any], key: str, where: str, default: int, minimum: int) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{where}.{key} must be an integer >= {minimum}, got {v!r}")
    return v


def parse_dense_comm_cfg(cfg: Mapping[str, Any] | None) -> DenseCommSpec:
    """Validate a `dense_comm` config (dict or DictConfig); errors name the key."""
    cfg = plain_config(cfg) if cfg is not None else {"name": "none"}
    where = "dense_comm"
    if not isinstance(cfg, Mapping):
        raise ValueError(f"{where} config must be a mapping, got {type(cfg).__name__}")
    name = cfg.get("name", "none")
    if name not in KINDS:
        raise ValueError(f"{where}.name must be one of {KINDS}, got {name!r}")
    check_keys(cfg, _COMMON | _KEYS[name], where)
    out: dict[str, Any] = {"name": name, "bucket_cap_mb": number(cfg, "bucket_cap_mb", where, 25.0, positive=True)}
    if name == "powersgd":
        out.update(
            rank=_int(cfg, "rank", where, 1, 1),
            start_iter=_int(cfg, "start_iter", where, 10, 0),
            min_compression_rate=number(cfg, "min_compression_rate", where, 2.0),
        )
        warm = cfg.get("warm_start", True)
        if not isinstance(warm, bool):
            raise ValueError(f"{where}.warm_start must be true or false, got {warm!r}")
        out["warm_start"] = warm
    if name == "dct":
        keep = number(cfg, "keep", where, 0.005, positive=True)
        if keep > 1:
            raise ValueError(f"{where}.keep is the fraction of entries sent, in (0, 1]; got {keep}")
        values = cfg.get("values", "none")
        if values not in VALUE_CODECS:
            raise ValueError(f"{where}.values must be one of {VALUE_CODECS}, got {values!r}")
        if "values_eb" in cfg and cfg["values_eb"] is not None and values != "lossy":
            raise ValueError(f"{where}.values_eb bounds lossy values only; {where}.values is {values!r}")
        out.update(
            keep=keep,
            refresh_every=_int(cfg, "refresh_every", where, 1000, 1),
            min_numel=_int(cfg, "min_numel", where, 256, 0),
            values=values,
            values_eb=number(cfg, "values_eb", where, 0.01, positive=True),
        )
    return DenseCommSpec(**out)
