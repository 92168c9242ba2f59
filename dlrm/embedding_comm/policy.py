"""The trainer's side of the error-bound policies: the `policy` config group -> a
:class:`compression.policies.Policy`, and the comm statistics fed back to its closed loop.

The bound math (classes, schedules, the control law) lives in :mod:`compression.policies`; this
module knows the config keys, the trainer's Criteo feature names and the statistics keys.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

import dlrm_compression as compression
from data.layout import SPARSE_NAMES
from dlrm.embedding_comm.config import CompressionSpec
from dlrm.embedding_comm.stats import per_feature
from dlrm.process.config_checks import check_keys, integer, number, one_of, plain_config
from dlrm_compression.policies import (
    CLASSES,
    DIRECTIONS,
    KAGGLE_LOOSE_FRACTION,
    KAGGLE_TIGHT_FRACTION,
    KINDS,
    PUBLISHED_BOUNDS,
    PUBLISHED_C,
    PUBLISHED_EARLY_STAGE,
    PUBLISHED_SCHEDULE,
    SCHEDULES,
    Control,
    DirectionRule,
    Plateau,
    Policy,
    Schedule,
    TableStats,
    automatic_classes,
    published_classes,
)

log = logging.getLogger(__name__)

_RULE_KEYS = {"kind", "eb", "bounds", "classes", "schedule", "scale", "control", "plateau", "window", "evaluation"}
_CLASS_KEYS = {"source", "dataset", "rank_by", "split", "tight", "loose"}
_SCHEDULE_KEYS = {"kind", "early_stage", "c"}
_CONTROL_KEYS = {"target", "min", "max", "gain", "max_step"}
_PLATEAU_KEYS = {"factor", "min_delta", "patience", "floor"}
_WINDOW_KEYS = {"start", "end"}
EVALUATIONS = ("train", "exact")
# which keys each kind requires / forbids (closed_loop takes any base)
_NEEDS = {
    "fixed": {"eb"},
    "table_wise": {"classes"},
    "iteration_wise": {"eb", "schedule"},
    "dual": {"classes", "schedule"},
    "closed_loop": {"control"},
}
_FORBIDS = {
    "fixed": {"classes", "schedule", "control"},
    "table_wise": {"eb", "schedule", "control"},
    "iteration_wise": {"classes", "control"},
    "dual": {"eb", "control"},
    "closed_loop": set(),
}
# What sets the level of each kind, for errors about keys that would have no effect.
_LEVEL = {
    "fixed": "eb",
    "iteration_wise": "eb",
    "closed_loop": "eb (the start) and control.target",
    "table_wise": "bounds.{tight,base,loose}",
    "dual": "bounds.{tight,base,loose}",
}


def table_stats(features: Sequence[str], num_embeddings: Sequence[int], dim: int) -> list[TableStats]:
    """What the policy may know of the trainer's tables; Criteo features ``cat_<i>`` carry column i."""
    column = {name: i for i, name in enumerate(SPARSE_NAMES)}
    return [TableStats(f, int(n), dim, column=column.get(f)) for f, n in zip(features, num_embeddings, strict=True)]


def _schedule(cfg: Any, where: str) -> Schedule:
    if not isinstance(cfg, Mapping):
        raise ValueError(f"{where} must be a mapping {{kind, early_stage, c}}, got {cfg!r}")
    check_keys(cfg, _SCHEDULE_KEYS, where)
    kind = one_of(cfg, "kind", where, SCHEDULES, PUBLISHED_SCHEDULE)
    es = integer(cfg, "early_stage", where, PUBLISHED_EARLY_STAGE, minimum=1)  # iterations
    try:
        return Schedule(kind, es, number(cfg, "c", where, PUBLISHED_C, positive=True))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _classes(cfg: Any, tables: Sequence[TableStats], where: str) -> dict[str, str]:
    if not isinstance(cfg, Mapping):
        raise ValueError(f"{where} must be a mapping (source: published|auto, ...), got {cfg!r}")
    check_keys(cfg, _CLASS_KEYS, where)
    source = cfg.get("source", "auto")
    if source == "published":
        extra = sorted(set(cfg) - {"source", "dataset"})
        if extra:
            raise ValueError(f"{where}: {extra} only apply to source: auto")
        if not tables:
            raise ValueError(f"{where}: published classes need the table list (TableStats)")
        try:
            return published_classes(str(cfg.get("dataset", "")), tables)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    if source != "auto":
        raise ValueError(f"{where}.source must be published or auto, got {source!r}")
    if "dataset" in cfg:
        raise ValueError(f"{where}.dataset only applies to source: published")
    split = cfg.get("split", "proportion")
    default_t, default_l = (KAGGLE_TIGHT_FRACTION, KAGGLE_LOOSE_FRACTION) if split != "threshold" else (None, None)
    return automatic_classes(
        tables,
        str(cfg.get("rank_by", "num_embeddings")),
        split,
        number(cfg, "tight", where, default_t),
        number(cfg, "loose", where, default_l),
    )


def _control(cfg: Any, where: str) -> Control:
    if not isinstance(cfg, Mapping):
        raise ValueError(f"{where} must be a mapping {{target, min, max, gain, max_step}}")
    check_keys(cfg, _CONTROL_KEYS, where)
    try:
        return Control(
            target=number(cfg, "target", where, positive=True),
            min=number(cfg, "min", where, positive=True),
            max=number(cfg, "max", where, positive=True),
            gain=number(cfg, "gain", where, 0.5),
            max_step=number(cfg, "max_step", where, 2.0),
        )
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _plateau(cfg: Any, where: str) -> Plateau:
    if not isinstance(cfg, Mapping):
        raise ValueError(f"{where} must be a mapping {{factor, min_delta, patience, floor}}, got {cfg!r}")
    check_keys(cfg, _PLATEAU_KEYS, where)
    d = Plateau()
    try:
        return Plateau(
            factor=number(cfg, "factor", where, d.factor, positive=True),
            min_delta=number(cfg, "min_delta", where, d.min_delta),
            patience=integer(cfg, "patience", where, d.patience, minimum=1),
            floor=number(cfg, "floor", where, d.floor, positive=True),
        )
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _window(cfg: Any, where: str) -> tuple[int, int | None]:
    if not isinstance(cfg, Mapping):
        raise ValueError(f"{where} must be a mapping {{start, end}} of iterations, got {cfg!r}")
    check_keys(cfg, _WINDOW_KEYS, where)
    start = integer(cfg, "start", where, 0)
    end = None if cfg.get("end") is None else integer(cfg, "end", where, minimum=start + 1)
    return start, end


def _extras(cfg: Mapping[str, Any], present: set[str], where: str) -> dict[str, Any]:
    """The keys every kind may take: plateau, window, evaluation (forward only)."""
    out: dict[str, Any] = {}
    if "plateau" in present:
        if "control" in present:
            raise ValueError(f"{where}.plateau: the closed loop ({where}.control) sets its own levels; use one")
        out["plateau"] = _plateau(cfg["plateau"], f"{where}.plateau")
    if "window" in present:
        out["window"] = _window(cfg["window"], f"{where}.window")
    out["evaluation"] = one_of(cfg, "evaluation", where, EVALUATIONS) if "evaluation" in present else "train"
    if out["evaluation"] != "train" and where.endswith("backward"):
        raise ValueError(f"{where}.evaluation: evaluation passes send no gradients (forward only)")
    return out


def _rule(cfg: Any, tables: Sequence[TableStats], where: str) -> DirectionRule:
    if not isinstance(cfg, Mapping):
        raise ValueError(f"{where} must be a mapping with a `kind` ({', '.join(KINDS)}), got {cfg!r}")
    check_keys(cfg, _RULE_KEYS, where)
    kind = one_of(cfg, "kind", where, KINDS)
    present = {k for k in cfg if cfg[k] is not None}
    missing, forbidden = sorted(_NEEDS[kind] - present), sorted(_FORBIDS[kind] & present)
    if missing:
        raise ValueError(f"{where}: kind {kind} needs {missing}")
    if forbidden:
        raise ValueError(
            f"{where}: kind {kind} takes no {forbidden} (it would have no effect); its level is "
            f"{where}.{_LEVEL[kind]}, times {where}.scale"
        )
    if "eb" in present and "classes" in present:
        raise ValueError(f"{where}: give either eb (one bound) or classes + bounds, not both")
    if "bounds" in present and "classes" not in present:
        raise ValueError(
            f"{where}.bounds only applies with classes (kind table_wise or dual); the level of kind "
            f"{kind} is {where}.{_LEVEL[kind]}"
        )
    scale = number(cfg, "scale", where, 1.0, positive=True)
    schedule = _schedule(cfg["schedule"], f"{where}.schedule") if "schedule" in present else None
    control = _control(cfg["control"], f"{where}.control") if "control" in present else None
    extras = _extras(cfg, present, where)
    if "classes" in present:
        bounds_cfg = cfg.get("bounds") or PUBLISHED_BOUNDS
        if not isinstance(bounds_cfg, Mapping):
            raise ValueError(f"{where}.bounds must be a mapping {{tight, base, loose}}, got {bounds_cfg!r}")
        check_keys(bounds_cfg, set(CLASSES), f"{where}.bounds")
        values = {k: number(bounds_cfg, k, f"{where}.bounds", PUBLISHED_BOUNDS[k]) for k in CLASSES}
        classes = _classes(cfg["classes"], tables, f"{where}.classes")
        return DirectionRule(
            kind,
            None,
            {f: values[c] for f, c in classes.items()},
            classes,
            scale,
            schedule,
            control,
            nominal=values["base"],
            **extras,
        )
    if "eb" not in present:
        raise ValueError(f"{where}: give eb (one bound) or classes (+ bounds)")
    eb = number(cfg, "eb", where)
    return DirectionRule(kind, eb, {t.feature: eb for t in tables}, {}, scale, schedule, control, nominal=eb, **extras)


def build_policy(
    cfg: Mapping[str, Any], tables: Sequence[TableStats], modes: Mapping[str, str] | None = None
) -> Policy:
    """The policy of a `policy` config (dict or DictConfig) for these tables; errors name the key.

    ``cfg``: ``{name, forward: {...}, backward: {...}}``, each direction ``{kind, eb | classes
    (+ bounds), schedule, scale, control}`` (see ``configs/policy/``). ``modes``: the compression
    config's ``mode`` per direction, if known; a closed loop in ``abs`` mode is refused.
    """
    cfg = plain_config(cfg)
    if not isinstance(cfg, Mapping):
        raise ValueError(f"policy config must be a mapping, got {type(cfg).__name__}")
    check_keys(cfg, {"name", *DIRECTIONS}, "policy")
    names = [t.feature for t in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate feature names in the table statistics: {names}")
    rules = {}
    for d in DIRECTIONS:
        if d not in cfg:
            raise ValueError(f"policy.{d} is missing: give {{kind: {'|'.join(KINDS)}, ...}}")
        rules[d] = _rule(cfg[d], tables, f"policy.{d}")
        if rules[d].control is not None and modes is not None and modes.get(d) == "abs":
            raise ValueError(
                f"policy.{d}: the closed loop estimates value ranges from relative bounds; "
                f"compression.{d}.mode is abs (use mode: rel)"
            )
    return Policy(str(cfg.get("name", "policy")), rules)


def bounded_directions(spec: CompressionSpec) -> list[str]:
    """The directions whose codec reads the policy's bounds (none for QComms, casts, thresholds)."""
    if spec.kind != "compressed":
        return []
    assert spec.forward is not None and spec.backward is not None
    return [d for d, s in (("forward", spec.forward), ("backward", spec.backward)) if compression.is_bounded(s.codec)]


def policy_for_run(cfg: Mapping[str, Any], spec: CompressionSpec, tables: Sequence[TableStats]) -> Policy | None:
    """The run's policy, or None where no codec asks for bounds (QComms, casts, DCT-MP)."""
    if not bounded_directions(spec):
        return None
    assert spec.forward is not None and spec.backward is not None
    policy = build_policy(cfg, tables, modes={"forward": spec.forward.mode, "backward": spec.backward.mode})
    if policy.closed_loop and spec.sample_every == 0:
        raise ValueError(
            f"policy {policy.name!r}: the closed loop ({', '.join(policy.closed_loop)}) steers by "
            "sampled errors, but compression.stats.sample_every is 0; set it > 0"
        )
    return policy


class TrainingBound:
    """A policy as the dists' ``bound_fn``, and a step observer of the training loop: a forward
    outside a training segment (an evaluation pass, the test pass) asks for the policy's
    evaluation bound. (Not grad mode: the all-to-all runs inside an autograd function's forward,
    where grad mode is off in training too.) A class, not a closure: the sharders holding it are
    pickled."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.training = True  # outside the loop (before it starts) as in training

    def __call__(self, feature: str, direction: str, iteration: int) -> float:
        return self.policy.bound(feature, direction, iteration, self.training or direction == "backward")

    def segment_start(self, model: torch.nn.Module) -> None:
        self.training = True

    def step_end(self, model: torch.nn.Module) -> None:
        return

    def segment_end(self, model: torch.nn.Module) -> None:
        self.training = False  # evaluation passes and checkpoints happen between segments


class PolicyFeedback:
    """Feeds a policy's closed loop the sampled errors of each log window (``comm_stats_all_ranks``
    output: the same merged statistics on every rank, hence the same bounds everywhere)."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._warned = False

    def observe(self, iteration: int, stats: Mapping[str, float]) -> None:
        errors = {d: per_feature(stats, d, "max_abs_error") for d in DIRECTIONS}
        silent = [d for d in self.policy.closed_loop if not errors[d]]
        if silent and not self._warned:
            log.warning(
                "closed-loop policy %r: no sampled errors for %s at iteration %d (a single process "
                "sends nothing); bounds unchanged",
                self.policy.name,
                silent,
                iteration,
            )
            self._warned = True
        self.policy.observe(iteration, errors)
