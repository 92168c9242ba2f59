"""The `compression` config group, validated in one place into small frozen specs.

Two kinds of config exist (see `configs/compression/`):

* ``kind: compressed`` (default) - our variable-size compressed all-to-alls, with ``forward`` and
  ``backward`` each ``{codec, mode, dedup, params}`` (the bounds come from the `policy` group);
* ``kind: qcomm`` - TorchRec's stock QComms path (fixed-rate fp16/bf16/int8/MX4 inside the
  stock collectives), with ``qcomm: {forward_precision, backward_precision}`` (MX4 also takes its
  group sizes, ``mx4_quantize_dim`` forward and ``mx4_quantize_dim_bwd`` backward).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from dlrm.process.config_checks import MOVED, check_keys, flag, integer, one_of, plain_config
from dlrm_compression.backend import CHOICES as BACKENDS

KINDS = ("compressed", "qcomm")
MODES = ("abs", "rel")
QCOMM_PRECISIONS = ("fp32", "fp16", "bf16", "int8", "mx4")
# Sharding types our sharder may let the planner choose; RW/TWRW are allowed on CPU too.
ALL_SHARDING_TYPES = ("data_parallel", "table_wise", "column_wise", "table_column_wise", "row_wise", "table_row_wise")
ROW_SUM_SHARDING_TYPES = ("row_wise", "table_row_wise")  # forward rows are partial sums (reduce-scatter)

INPUT_CODECS = ("none", "ids", "auto")  # compression.input (auto: compression=auto's strategy decides)
_TOP_KEYS = {
    "name",
    "kind",
    "input",
    "forward",
    "backward",
    "qcomm",
    "stats",
    "sharding_types",
    "strategy",
    "strategy_file",
    "backend",
}
_DIR_KEYS = {"codec", "mode", "dedup", "params", "cache"}
_CACHE_KEYS = {"enabled", "capacity_rows"}
_STATS_KEYS = {"sample_every", "cache_probe"}
_CACHE_PROBE_KEYS = {"enabled", "capacity_rows"}
_QCOMM_KEYS = {"forward_precision", "backward_precision", "mx4_quantize_dim", "mx4_quantize_dim_bwd"}


@dataclass(frozen=True)
class DirectionSpec:
    """How one direction (forward embeddings or backward gradients) is compressed."""

    codec: str
    mode: str = "abs"  # how the policy's bound reads: absolute, or relative to each block's range
    dedup: bool = True  # forward: pass ids to the codec; backward: also sum duplicate-id gradients
    params: Mapping[str, Any] = field(default_factory=dict)
    cache_rows: int | None = (
        None  # forward row cache (dlrm.embedding_comm.forward_cache): capacity (0: unlimited); None: off
    )


@dataclass(frozen=True)
class CompressionSpec:
    """A whole `compression` config entry."""

    name: str
    kind: str = "compressed"
    forward: DirectionSpec | None = None
    backward: DirectionSpec | None = None
    qcomm_forward: str = "fp32"
    qcomm_backward: str = "fp32"
    # MX4's group sizes (values sharing one exponent), forward and backward; None: FBGEMM's default
    qcomm_mx4_dim: int | None = None
    qcomm_mx4_dim_bwd: int | None = None
    sample_every: int = 10  # sender-side error and per-feature size sampling period (0: never)
    # compression.stats.cache_probe: measure what a forward row cache would save (None: off);
    # its value is the cache's capacity in rows per destination and table (0: unlimited)
    cache_probe_rows: int | None = None
    sharding_types: tuple[str, ...] = ALL_SHARDING_TYPES
    # compression=auto (per_block codecs): when to calibrate and re-plan, or a strategy to replay
    strategy: Mapping[str, Any] = field(default_factory=dict)
    strategy_file: str | None = None
    input: str = "none"  # compression.input: none | ids | auto (the KJT all-to-all, coded losslessly)
    # where the codecs' per-chunk stages run: auto (the host's shortcuts on a CPU, the device's
    # code elsewhere) | host | device (e.g. the device code on a CPU, as the launch counts run it)
    backend: str = "auto"

    @property
    def auto(self) -> bool:
        """Whether a strategy chooses the codec of every table (the per_block codec)."""
        return self.kind == "compressed" and "per_block" in (
            self.forward and self.forward.codec,
            self.backward and self.backward.codec,
        )


def _direction(cfg: Any, where: str) -> DirectionSpec:
    if not isinstance(cfg, Mapping):
        raise ValueError(f"{where} must be a mapping {{codec, mode, dedup, params}}, got {cfg!r}")
    if "eb" in cfg:
        raise ValueError(f"{where}.eb: {MOVED[where + '.eb']}")
    check_keys(cfg, _DIR_KEYS, where)
    if "codec" not in cfg or not isinstance(cfg["codec"], str):
        raise ValueError(f"{where}.codec must name a codec (none, fp16, bf16, int8, lossy), got {cfg.get('codec')!r}")
    mode = one_of(cfg, "mode", where, MODES, "abs")
    dedup = flag(cfg, "dedup", where, True)
    params = cfg.get("params") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"{where}.params must be a mapping of codec keyword arguments, got {params!r}")
    return DirectionSpec(codec=cfg["codec"], mode=mode, dedup=dedup, params=dict(params), cache_rows=_cache(cfg, where))


def _cache(cfg: Mapping[str, Any], where: str) -> int | None:
    """``<direction>.cache: {enabled, capacity_rows}``: the capacity when enabled, else None."""
    cache = cfg.get("cache") or {}
    key = f"{where}.cache"
    if not isinstance(cache, Mapping):
        raise ValueError(f"{key} must be a mapping {{enabled, capacity_rows}}, got {cache!r}")
    check_keys(cache, _CACHE_KEYS, key)
    enabled, capacity = flag(cache, "enabled", key, False), integer(cache, "capacity_rows", key, 0)  # 0: unlimited
    if not enabled:
        return None
    if not where.endswith("forward"):
        raise ValueError(f"{key}: the row cache applies to the forward all-to-all only")
    if cfg["codec"] != "lossy" or not cfg.get("dedup", True):
        raise ValueError(
            f"{key} needs the error-bounded codec by id ({where}.codec: lossy, {where}.dedup: true), "
            f"got codec {cfg['codec']!r}, dedup {cfg.get('dedup', True)!r}"
        )
    return capacity


def parse_compression_cfg(cfg: Mapping[str, Any]) -> CompressionSpec:
    """Validate a `compression` config (dict or DictConfig); errors name the offending key."""
    cfg = plain_config(cfg)
    where = "compression"
    if not isinstance(cfg, Mapping):
        raise ValueError(f"{where} config must be a mapping, got {type(cfg).__name__}")
    check_keys(cfg, _TOP_KEYS, where)
    name = str(cfg.get("name", "unnamed"))
    kind = one_of(cfg, "kind", where, KINDS, "compressed")
    stats = cfg.get("stats") or {}
    check_keys(stats, _STATS_KEYS, f"{where}.stats")
    sample_every = integer(stats, "sample_every", f"{where}.stats", 10)
    probe = stats.get("cache_probe") or {}
    check_keys(probe, _CACHE_PROBE_KEYS, f"{where}.stats.cache_probe")
    enabled = flag(probe, "enabled", f"{where}.stats.cache_probe", False)
    capacity = integer(probe, "capacity_rows", f"{where}.stats.cache_probe", 0)  # 0: unlimited
    types = cfg.get("sharding_types") or ALL_SHARDING_TYPES
    bad = [t for t in types if t not in ALL_SHARDING_TYPES]
    if bad:
        raise ValueError(f"{where}.sharding_types: {bad} not in {list(ALL_SHARDING_TYPES)}")
    common = dict(name=name, kind=kind, sample_every=sample_every, sharding_types=tuple(types))
    common["input"] = one_of(cfg, "input", where, INPUT_CODECS, "none")
    common["backend"] = one_of(cfg, "backend", where, BACKENDS, "auto")
    if kind == "qcomm" and common["input"] != "none":
        raise ValueError(
            f"{where}.input={common['input']} codes the input all-to-all of our compressed path (kind: compressed); "
            f"kind qcomm runs TorchRec's own input dist: set {where}.input=none or a compression of kind compressed"
        )
    cache_probe_rows = capacity if enabled else None
    if kind == "qcomm" and common["backend"] != "auto":
        raise ValueError(f"{where}.backend has no effect with kind qcomm (TorchRec's own collectives): drop it")
    if kind == "qcomm":
        if "forward" in cfg or "backward" in cfg:
            raise ValueError(
                f"{where}: kind qcomm takes `qcomm: {{forward_precision, backward_precision}}`"
                ", not forward/backward codec entries"
            )
        q = cfg.get("qcomm") or {}
        check_keys(q, _QCOMM_KEYS, f"{where}.qcomm")
        if enabled:
            raise ValueError(f"{where}.stats.cache_probe needs our compressed path (kind: compressed), not kind qcomm")
        fwd, bwd = q.get("forward_precision", "fp32"), q.get("backward_precision", "fp32")
        for key, val in (("forward_precision", fwd), ("backward_precision", bwd)):
            if val not in QCOMM_PRECISIONS:
                raise ValueError(f"{where}.qcomm.{key} must be one of {QCOMM_PRECISIONS}, got {val!r}")
        mx4_keys = ("mx4_quantize_dim", "mx4_quantize_dim_bwd")
        dims = {key: integer(q, key, f"{where}.qcomm", 0) or None for key in mx4_keys}  # 0/absent: FBGEMM's
        if "mx4" not in (fwd, bwd) and any(dims.values()):
            raise ValueError(
                f"{where}.qcomm.mx4_quantize_dim(_bwd) only apply to MX4: set forward_precision or "
                f"backward_precision to mx4 (got {fwd!r}, {bwd!r})"
            )
        return CompressionSpec(
            qcomm_forward=fwd,
            qcomm_backward=bwd,
            qcomm_mx4_dim=dims["mx4_quantize_dim"],
            qcomm_mx4_dim_bwd=dims["mx4_quantize_dim_bwd"],
            **common,
        )
    if "qcomm" in cfg:
        raise ValueError(f"{where}.qcomm is only read with kind: qcomm (kind is {kind!r})")
    for key in ("forward", "backward"):
        if key not in cfg:
            raise ValueError(f"{where}.{key} is missing: give {{codec: ..., mode: abs|rel, dedup: ...}}")
    spec = CompressionSpec(
        forward=_direction(cfg["forward"], f"{where}.forward"),
        backward=_direction(cfg["backward"], f"{where}.backward"),
        strategy=dict(cfg.get("strategy") or {}),
        strategy_file=cfg.get("strategy_file"),
        cache_probe_rows=cache_probe_rows,
        **common,
    )
    if spec.input == "auto" and not spec.auto:
        raise ValueError(
            f"{where}.input=auto is decided by compression=auto's strategy (per_block codecs), but "
            f"{where}.forward.codec is {spec.forward and spec.forward.codec!r}: "
            f"set {where}.input=ids or none, or use compression=auto"
        )
    if not spec.auto and (spec.strategy or spec.strategy_file):
        raise ValueError(
            f"{where}.strategy and {where}.strategy_file only apply to compression=auto (per_block codecs)"
        )
    if spec.forward is not None and spec.forward.cache_rows is not None:  # table rows by id: no partial sums
        cut = [t for t in spec.sharding_types if t in ROW_SUM_SHARDING_TYPES]
        if cut and cfg.get("sharding_types"):
            raise ValueError(
                f"{where}.forward.cache cannot apply to {cut} sharding (their forward rows are partial sums, not "
                f"table rows with ids): drop them from {where}.sharding_types or disable the cache"
            )
        spec = replace(spec, sharding_types=tuple(t for t in spec.sharding_types if t not in cut))
    return spec


def excluded_sharding_types(spec: CompressionSpec) -> dict[str, str]:
    """Sharding types a setting of ``spec`` rules out, and why (naming the key), for errors."""
    if spec.forward is not None and spec.forward.cache_rows is not None:
        why = (
            "compression.forward.cache.enabled=true (its forward rows are partial sums, not table rows with ids): "
            "disable the cache or pick table_wise, column_wise or table_column_wise"
        )
        return dict.fromkeys(ROW_SUM_SHARDING_TYPES, why)
    return {}
