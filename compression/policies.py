"""Error-bound policies: the bound each table gets, per direction and training iteration.

The compressed all-to-all asks ``bound_fn(feature, direction, iteration) -> float`` for every
table block it sends; a :class:`Policy` is such a callable, built from the ``policy`` config group
by :func:`build_policy`. The value is read in the compression config's mode for that direction
(``rel``: a fraction of the block's value range in the chunk; ``abs``: the bound itself).

Kinds (each direction has its own): ``fixed`` (one bound), ``table_wise`` (tight/base/loose
classes of tables), ``iteration_wise`` (a multiplier schedule over the early stage), ``dual``
(table-wise x iteration-wise, the published method of Feng et al., SC'24, arXiv 2407.04272:
rules in ``PUBLISHED_*`` below, from the authors' artifact ``allenfengjr/dlrm_comp``), and
``closed_loop`` (ours: any of the above, then corrected per table from measured errors; see
:class:`Control`). The rules are plain functions (:func:`schedule_multiplier`,
:func:`published_classes`, :func:`automatic_classes`, :func:`control_update`) that the policy
composes, so each is checked against the published formulas on its own.

Pure Python: no torch, torchrec or dlrm import.
"""

from __future__ import annotations

import logging
import math
import re
import statistics
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

log = logging.getLogger(__name__)

DIRECTIONS = ("forward", "backward")
CLASSES = ("tight", "base", "loose")
KINDS = ("fixed", "table_wise", "iteration_wise", "dual", "closed_loop")
SCHEDULES = ("step", "linear", "log", "constant", "none")

# The published table classes, by Criteo column index (C1 = 0), and their relative bounds
# (build_error_bound() and SC_ADAE_scripts/{kaggle,tb}_run.sh of the artifact).
PUBLISHED_TABLES: dict[str, dict[str, tuple[int, ...]]] = {
    "kaggle": {"tight": (2, 3, 9, 11, 15, 20, 23, 25), "loose": (8, 16, 19, 21, 22, 24)},
    "terabyte": {"tight": (0, 9, 10, 19, 20, 21, 22), "loose": (5, 8, 12, 15, 16, 17, 18, 24, 25)},
}
PUBLISHED_BOUNDS = {"tight": 0.01, "base": 0.03, "loose": 0.05}
PUBLISHED_NUM_TABLES = 26
# stage_check(): multiplier EB_CONSTANT decaying to 1 by EARLY_STAGE; DECAY_FUNC="step" by default.
PUBLISHED_C = 2.0
PUBLISHED_EARLY_STAGE = 65536
PUBLISHED_SCHEDULE = "step"
# Class sizes of the automatic mode by default: the Kaggle lists' 8 tight and 6 loose of 26.
KAGGLE_TIGHT_FRACTION = 8 / 26
KAGGLE_LOOSE_FRACTION = 6 / 26

_FEATURE_INDEX = re.compile(r"^(?:t_)?cat_(\d+)$")  # trainer features cat_i / tables t_cat_i


@dataclass(frozen=True)
class TableStats:
    """What a policy may know about a table: its feature name and size, optionally measured values.

    ``value_range``: max - min of its embedding values (e.g. of a sample of pooled rows);
    ``dedup_ratio``: rows / unique rows in a typical batch (>= 1; high for small, hot tables).
    """

    feature: str
    num_embeddings: int
    dim: int
    value_range: float | None = None
    dedup_ratio: float | None = None


# ---------------------------------------------------------------------------------------------
# Iteration-wise: multiplier schedules (stage_check of the artifact)


def schedule_multiplier(kind: str, iteration: int, early_stage: int = PUBLISHED_EARLY_STAGE,
                        c: float = PUBLISHED_C) -> float:
    """The bound multiplier at ``iteration``: ``c`` at 0, reaching 1 at ``early_stage``, 1 after.

    step: ``c * max(1 - n * (1 - 1/c) / 10, 1/c)`` with ``n = floor(10 * it / ES)`` (2.0, 1.9, ..., 1.1);
    linear: ``c * (1 - (it/ES) * (1 - 1/c))``; log: ``c * (s * (1 - 1/c) + 1/c)`` with
    ``s = 1 - ln(1 + (it/ES) * (e - 1))``; constant: ``c`` before ES; none: always 1.
    """
    if kind not in SCHEDULES:
        raise ValueError(f"schedule kind must be one of {SCHEDULES}, got {kind!r}")
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    if kind == "none" or iteration >= early_stage:
        return 1.0
    t = iteration / early_stage
    if kind == "step":
        n = (10 * iteration) // early_stage  # integer floor: no float edge at the step boundaries
        return c * max(1.0 - n * (1.0 - 1.0 / c) / 10.0, 1.0 / c)
    if kind == "linear":
        return c * (1.0 - t * (1.0 - 1.0 / c))
    if kind == "log":
        s = 1.0 - math.log(1.0 + t * (math.e - 1.0))
        return c * (s * (1.0 - 1.0 / c) + 1.0 / c)
    return c  # constant


@dataclass(frozen=True)
class Schedule:
    """An iteration-wise multiplier schedule (``kind``, ``early_stage`` iterations, start value ``c``)."""

    kind: str = PUBLISHED_SCHEDULE
    early_stage: int = PUBLISHED_EARLY_STAGE
    c: float = PUBLISHED_C

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"schedule kind must be one of {SCHEDULES}, got {self.kind!r}")
        if self.early_stage <= 0:
            raise ValueError(f"schedule early_stage must be > 0 iterations, got {self.early_stage}")
        if not (self.c >= 1 and math.isfinite(self.c)):
            # the published formulas loosen early (c >= 1); below 1 the step formula degenerates
            raise ValueError(f"schedule c must be finite and >= 1, got {self.c}")

    def __call__(self, iteration: int) -> float:
        return schedule_multiplier(self.kind, iteration, self.early_stage, self.c)

    def max_over(self, start: int, end: int) -> float:
        """Largest multiplier on ``[start, end]`` (every schedule is monotone in the iteration)."""
        return max(self(max(start, 0)), self(max(end, 0)))


# ---------------------------------------------------------------------------------------------
# Table-wise: tight / base / loose classes


def feature_index(feature: str) -> int:
    """Criteo column index of a trainer feature (``cat_i`` or table ``t_cat_i`` -> i)."""
    m = _FEATURE_INDEX.match(feature)
    if not m:
        raise ValueError(f"feature {feature!r} is not named cat_<i> (Criteo column C<i+1>); the "
                         "published table lists need the trainer's Criteo feature names")
    return int(m.group(1))


def published_classes(dataset: str, features: Sequence[str]) -> dict[str, str]:
    """Class of each feature under the published hard-coded lists (``kaggle`` or ``terabyte``)."""
    if dataset not in PUBLISHED_TABLES:
        raise ValueError(f"published table lists exist for {sorted(PUBLISHED_TABLES)}, got {dataset!r}")
    lists = PUBLISHED_TABLES[dataset]
    out = {}
    for f in features:
        i = feature_index(f)
        if not 0 <= i < PUBLISHED_NUM_TABLES:
            raise ValueError(f"feature {f!r}: index {i} outside the {PUBLISHED_NUM_TABLES} Criteo tables")
        out[f] = "tight" if i in lists["tight"] else "loose" if i in lists["loose"] else "base"
    return out


RANK_BY = ("num_embeddings", "value_range", "dedup_ratio")
SPLITS = ("proportion", "quantile", "threshold")


def _tightness(t: TableStats, rank_by: str) -> float:
    """Higher = tighter bound: many rows, a wide range, or few duplicates per batch."""
    if rank_by == "num_embeddings":
        return float(t.num_embeddings)
    value = getattr(t, rank_by)
    if value is None:
        raise ValueError(f"table {t.feature!r} has no measured {rank_by}; classes ranked by {rank_by} "
                         "need it in every TableStats")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"table {t.feature!r}: {rank_by} must be finite and > 0, got {value}")
    return float(value) if rank_by == "value_range" else 1.0 / float(value)


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default) of an ascending list."""
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (pos - lo) * (sorted_values[hi] - sorted_values[lo])


def automatic_classes(tables: Sequence[TableStats], rank_by: str = "num_embeddings", split: str = "proportion",
                      tight: float = KAGGLE_TIGHT_FRACTION, loose: float = KAGGLE_LOOSE_FRACTION) -> dict[str, str]:
    """Classes from measured statistics instead of hard-coded lists.

    Tables are ranked by ``rank_by`` (the published classes follow cardinality: biggest tables
    tight, smallest loose). ``split``: ``proportion`` - the top ``round(n * tight)`` tables are
    tight and the bottom ``round(n * loose)`` loose (ties broken by table order; the defaults give
    8 and 6 of 26, the Kaggle lists' sizes); ``quantile`` - tight above the ``1 - tight`` quantile
    of the statistic, loose below the ``loose`` quantile (ties share a class); ``threshold`` -
    tight if the statistic >= ``tight``, loose if <= ``loose`` (values in the statistic's units;
    for ``dedup_ratio`` the other way round: tight if <= ``tight``, loose if >= ``loose``).
    """
    if rank_by not in RANK_BY:
        raise ValueError(f"classes.rank_by must be one of {RANK_BY}, got {rank_by!r}")
    if split not in SPLITS:
        raise ValueError(f"classes.split must be one of {SPLITS}, got {split!r}")
    if not tables:
        raise ValueError("automatic table classes need the tables' statistics (got no TableStats)")
    names = [t.feature for t in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate feature names in the table statistics: {names}")
    score = {t.feature: _tightness(t, rank_by) for t in tables}
    n = len(tables)
    if split == "threshold":
        if rank_by == "dedup_ratio":  # thresholds in the statistic's own units: few duplicates = tight
            is_tight = {t.feature: t.dedup_ratio <= tight for t in tables}
            is_loose = {t.feature: t.dedup_ratio >= loose for t in tables}
        else:
            is_tight = {f: s >= tight for f, s in score.items()}
            is_loose = {f: s <= loose for f, s in score.items()}
        if any(is_tight[f] and is_loose[f] for f in names):
            raise ValueError(f"classes thresholds overlap (tight {tight}, loose {loose}): a table would be both")
        return {f: "tight" if is_tight[f] else "loose" if is_loose[f] else "base" for f in names}
    if not (0 <= tight <= 1 and 0 <= loose <= 1 and tight + loose <= 1):
        raise ValueError(f"classes.tight and classes.loose are fractions of the tables summing to <= 1, "
                         f"got {tight} and {loose}")
    if split == "proportion":
        order = sorted(range(n), key=lambda i: (-score[names[i]], i))  # biggest first, stable
        n_tight, n_loose = round(n * tight), round(n * loose)
        n_loose = min(n_loose, n - n_tight)
        out = {f: "base" for f in names}
        for i in order[:n_tight]:
            out[names[i]] = "tight"
        for i in order[n - n_loose:]:
            out[names[i]] = "loose"
        return out
    values = sorted(score.values())
    hi, lo = _quantile(values, 1 - tight), _quantile(values, loose)
    return {f: "tight" if tight > 0 and s >= hi else "loose" if loose > 0 and s <= lo else "base"
            for f, s in score.items()}


# ---------------------------------------------------------------------------------------------
# Closed loop (ours, opt-in)


@dataclass(frozen=True)
class Control:
    """Closed-loop correction of each table's bound from the sampled compression errors.

    Why: a relative bound gives each table an absolute error proportional to its own value
    range, and the ranges of embedding tables differ by orders of magnitude (TorchRec's default
    init alone is +-sqrt(1/rows)) and drift during training. For a fixed byte budget the summed
    squared error reaching the interaction layer is smallest when every table carries about the
    same absolute error (reverse water-filling); tables whose values are narrower than that
    level cost little anyway. So the controller steers each table toward an absolute error of
    ``target`` x the median table's value range, within the relative limits ``[min, max]``.

    How: at each :meth:`Policy.observe` it reads ``comm/<direction>/max_abs_error/<feature>`` (the
    sender-side sampled maximum error of the window) and divides it by the largest relative bound
    the policy handed out in that window to estimate the table's value range ``r_f``. The wanted
    relative bound is ``target * median(r) / r_f``; the table's gain moves toward it
    geometrically (``gain`` = fraction of the log-distance per update, at most a factor
    ``max_step``), and the final bound is clamped to ``[min, max]``. Tables without a sample in
    the window keep their gain. Given the same sequence of observed statistics the bounds are
    the same (feed it ``comm_stats_all_ranks`` and every rank agrees). Meaningful in ``rel`` mode.
    """

    target: float
    min: float
    max: float
    gain: float = 0.5
    max_step: float = 2.0

    def __post_init__(self) -> None:
        if not (0 < self.min <= self.max and math.isfinite(self.max)):
            raise ValueError(f"control limits need 0 < min <= max < inf, got min {self.min}, max {self.max}")
        if not (self.target > 0 and math.isfinite(self.target)):
            raise ValueError(f"control.target must be finite and > 0, got {self.target}")
        if not 0 < self.gain <= 1:
            raise ValueError(f"control.gain must be in (0, 1], got {self.gain}")
        if not self.max_step > 1:
            raise ValueError(f"control.max_step must be > 1, got {self.max_step}")


def control_update(bounds: Mapping[str, float], errors: Mapping[str, float], control: Control) -> dict[str, float]:
    """New un-scheduled relative bounds from the bounds used in a window and the errors measured.

    ``bounds[f]``: the largest relative bound handed out for ``f`` in the window; ``errors[f]``:
    the sampled max abs error of ``f``. Tables with no usable measurement keep their bound.
    """
    ranges = {f: errors[f] / b for f, b in bounds.items()
              if f in errors and b > 0 and math.isfinite(errors[f]) and errors[f] > 0}
    if not ranges:
        return dict(bounds)
    reference = statistics.median(ranges.values())
    out = dict(bounds)
    for f, r in ranges.items():
        wanted = control.target * reference / r
        step = (wanted / bounds[f]) ** control.gain
        step = min(max(step, 1.0 / control.max_step), control.max_step)
        out[f] = min(max(bounds[f] * step, control.min), control.max)
    return out


# ---------------------------------------------------------------------------------------------
# One direction's rule and the policy


@dataclass
class DirectionRule:
    """One direction: per-table base bounds x ``scale`` x schedule multiplier, with an optional
    closed-loop gain per table (``gains``, 1 until :meth:`Policy.observe` changes it)."""

    kind: str
    default: float | None  # bound of a table the rule has no entry for (None: such a table is an error)
    tables: dict[str, float] = field(default_factory=dict)
    classes: dict[str, str] = field(default_factory=dict)
    scale: float = 1.0
    schedule: Schedule | None = None
    control: Control | None = None
    gains: dict[str, float] = field(default_factory=dict)
    nominal: float = 0.0  # the "base" bound of this rule, for summaries

    def static(self, feature: str) -> float:
        """The table's bound before schedule and clamping: base x scale x closed-loop gain."""
        base = self.tables.get(feature, self.default)
        if base is None:
            raise KeyError(f"no error bound for feature {feature!r}: the policy knows the tables "
                           f"{sorted(self.tables)}")
        return base * self.scale * self.gains.get(feature, 1.0)

    def bound(self, feature: str, iteration: int) -> float:
        value = self.static(feature) * (self.schedule(iteration) if self.schedule else 1.0)
        if self.control is not None:
            value = min(max(value, self.control.min), self.control.max)
        return value


class Policy:
    """``bound(feature, direction, iteration) -> float`` (also ``policy(...)``), one rule per direction."""

    def __init__(self, name: str, rules: Mapping[str, DirectionRule]) -> None:
        missing = [d for d in DIRECTIONS if d not in rules]
        if missing:
            raise ValueError(f"policy {name!r} has no rule for {missing}")
        self.name = name
        self.rules = dict(rules)
        self._window_start = 0  # iteration of the previous observe()
        self._warned = False

    def bound(self, feature: str, direction: str, iteration: int) -> float:
        """The bound for ``feature``'s block in ``direction`` at training ``iteration``."""
        rule = self.rules.get(direction)
        if rule is None:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        return rule.bound(feature, int(iteration))

    __call__ = bound  # a Policy is a dlrm.comm BoundFn

    def bounds(self, direction: str, iteration: int, features: Sequence[str] | None = None) -> dict[str, float]:
        """Every known (or given) table's bound at ``iteration``, e.g. for TensorBoard."""
        rule = self.rules[direction]
        return {f: rule.bound(f, iteration) for f in (features if features is not None else sorted(rule.tables))}

    def observe(self, iteration: int, stats: Mapping[str, float]) -> None:
        """Feed the comm statistics of the window ending at ``iteration`` (``comm_stats`` keys,
        with or without the ``comm/`` prefix); only ``closed_loop`` rules react."""
        start, self._window_start = self._window_start, int(iteration)
        flat = {k[5:] if k.startswith("comm/") else k: float(v) for k, v in stats.items()}
        for d, rule in self.rules.items():
            if rule.control is None:
                continue
            prefix = f"{d}/max_abs_error/"
            errors = {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}
            if not errors:
                if not self._warned:
                    log.warning("closed-loop policy %r: no %s* keys in the statistics at iteration %d "
                                "(is compression.stats.sample_every > 0 and the run multi-rank?); "
                                "bounds unchanged", self.name, prefix, iteration)
                    self._warned = True
                continue
            # the schedule only decays: its largest value in the window is at one of its ends (+-1
            # for the pipeline's one-batch lead)
            sched = rule.schedule.max_over(start - 1, int(iteration) + 1) if rule.schedule else 1.0
            used, known = {}, {}
            for f in errors:
                try:
                    s = rule.static(f)
                except KeyError:
                    continue  # a table this rule has no entry for: nothing to correct
                known[f] = s
                used[f] = min(max(s * sched, rule.control.min), rule.control.max)
            control = rule.control
            if rule.scale != 1.0:  # `scale` is the one knob of every kind: here it scales the target
                control = Control(control.target * rule.scale, control.min, control.max, control.gain,
                                  control.max_step)
            new = control_update(used, errors, control)
            for f, s in known.items():
                if new[f] != used[f]:
                    # divide the schedule back out: the gain corrects the table, the schedule stays
                    rule.gains[f] = rule.gains.get(f, 1.0) * (new[f] / sched) / s

    def state_dict(self) -> dict[str, Any]:
        """Closed-loop state to checkpoint (gains per direction and table, last observed iteration)."""
        return {"gains": {d: dict(r.gains) for d, r in self.rules.items()}, "window_start": self._window_start}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (on resume, so a closed loop continues where it was)."""
        for d, gains in state.get("gains", {}).items():
            if d not in self.rules:
                raise ValueError(f"policy state names direction {d!r}; the policy has {sorted(self.rules)}")
            self.rules[d].gains = {str(f): float(g) for f, g in gains.items()}
        self._window_start = int(state.get("window_start", 0))

    def summary(self) -> dict[str, Any]:
        """Flat keys for metrics.json: the policy name and each direction's kind and base bound."""
        out: dict[str, Any] = {"policy": self.name}
        for d, r in self.rules.items():
            out[f"policy_{d}_kind"] = r.kind
            # the level a sweep varies: the base bound, or the closed loop's error target
            out[f"policy_{d}_bound"] = (r.control.target if r.control else r.nominal) * r.scale
        return out

    def __repr__(self) -> str:
        return f"Policy({self.name!r}, " + ", ".join(f"{d}={r.kind}" for d, r in self.rules.items()) + ")"


# ---------------------------------------------------------------------------------------------
# Config -> policy

_RULE_KEYS = {"kind", "eb", "bounds", "classes", "schedule", "scale", "control"}
_CLASS_KEYS = {"source", "dataset", "rank_by", "split", "tight", "loose"}
_SCHEDULE_KEYS = {"kind", "early_stage", "c"}
_CONTROL_KEYS = {"target", "min", "max", "gain", "max_step"}
# which keys each kind requires / forbids (closed_loop takes any base)
_NEEDS = {"fixed": {"eb"}, "table_wise": {"classes"}, "iteration_wise": {"eb", "schedule"},
          "dual": {"classes", "schedule"}, "closed_loop": {"control"}}
_FORBIDS = {"fixed": {"classes", "schedule", "control"}, "table_wise": {"eb", "schedule", "control"},
            "iteration_wise": {"classes", "control"}, "dual": {"eb", "control"}, "closed_loop": set()}


def plain_config(cfg: Any) -> Any:
    """An OmegaConf container (or anything else) as plain Python, without importing omegaconf."""
    to_container = getattr(type(cfg), "__module__", "").startswith("omegaconf")
    if to_container:
        from omegaconf import OmegaConf

        return OmegaConf.to_container(cfg, resolve=True)
    return cfg


def check_keys(cfg: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(cfg) - allowed)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")


def _number(cfg: Mapping[str, Any], key: str, where: str, default: float | None = None,
            positive: bool = False) -> float:
    if key not in cfg or cfg[key] is None:
        if default is None:
            raise ValueError(f"{where}.{key} is missing")
        return default
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{where}.{key} must be a number, got {v!r}")
    v = float(v)
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise ValueError(f"{where}.{key} must be finite and {'> 0' if positive else '>= 0'}, got {v}")
    return v


def _schedule(cfg: Any, where: str) -> Schedule:
    if not isinstance(cfg, Mapping):
        raise ValueError(f"{where} must be a mapping {{kind, early_stage, c}}, got {cfg!r}")
    check_keys(cfg, _SCHEDULE_KEYS, where)
    kind = cfg.get("kind", PUBLISHED_SCHEDULE)
    if kind not in SCHEDULES:
        raise ValueError(f"{where}.kind must be one of {SCHEDULES}, got {kind!r}")
    es = cfg.get("early_stage", PUBLISHED_EARLY_STAGE)
    if isinstance(es, bool) or not isinstance(es, int) or es <= 0:
        raise ValueError(f"{where}.early_stage must be a positive integer (iterations), got {es!r}")
    try:
        return Schedule(kind, es, _number(cfg, "c", where, PUBLISHED_C, positive=True))
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
        return published_classes(str(cfg.get("dataset", "")), [t.feature for t in tables])
    if source != "auto":
        raise ValueError(f"{where}.source must be published or auto, got {source!r}")
    if "dataset" in cfg:
        raise ValueError(f"{where}.dataset only applies to source: published")
    split = cfg.get("split", "proportion")
    default_t, default_l = (KAGGLE_TIGHT_FRACTION, KAGGLE_LOOSE_FRACTION) if split != "threshold" else (None, None)
    return automatic_classes(tables, str(cfg.get("rank_by", "num_embeddings")), split,
                             _number(cfg, "tight", where, default_t), _number(cfg, "loose", where, default_l))


def _rule(cfg: Any, tables: Sequence[TableStats], where: str) -> DirectionRule:
    if not isinstance(cfg, Mapping):
        raise ValueError(f"{where} must be a mapping with a `kind` ({', '.join(KINDS)}), got {cfg!r}")
    check_keys(cfg, _RULE_KEYS, where)
    kind = cfg.get("kind")
    if kind not in KINDS:
        raise ValueError(f"{where}.kind must be one of {KINDS}, got {kind!r}")
    present = {k for k in cfg if cfg[k] is not None}
    missing, forbidden = sorted(_NEEDS[kind] - present), sorted(_FORBIDS[kind] & present)
    if missing:
        raise ValueError(f"{where}: kind {kind} needs {missing}")
    if forbidden:
        raise ValueError(f"{where}: kind {kind} takes no {forbidden}")
    if "eb" in present and "classes" in present:
        raise ValueError(f"{where}: give either eb (one bound) or classes + bounds, not both")
    if "bounds" in present and "classes" not in present:
        raise ValueError(f"{where}.bounds only applies with classes")
    scale = _number(cfg, "scale", where, 1.0, positive=True)
    schedule = _schedule(cfg["schedule"], f"{where}.schedule") if "schedule" in present else None
    control = None
    if "control" in present:
        c = cfg["control"]
        if not isinstance(c, Mapping):
            raise ValueError(f"{where}.control must be a mapping {{target, min, max, gain, max_step}}")
        check_keys(c, _CONTROL_KEYS, f"{where}.control")
        cw = f"{where}.control"
        try:
            control = Control(target=_number(c, "target", cw, positive=True), min=_number(c, "min", cw, positive=True),
                              max=_number(c, "max", cw, positive=True), gain=_number(c, "gain", cw, 0.5),
                              max_step=_number(c, "max_step", cw, 2.0))
        except ValueError as e:
            raise ValueError(f"{cw}: {e}") from None
    if "classes" in present:
        bounds_cfg = cfg.get("bounds") or PUBLISHED_BOUNDS
        if not isinstance(bounds_cfg, Mapping):
            raise ValueError(f"{where}.bounds must be a mapping {{tight, base, loose}}, got {bounds_cfg!r}")
        check_keys(bounds_cfg, set(CLASSES), f"{where}.bounds")
        values = {k: _number(bounds_cfg, k, f"{where}.bounds", PUBLISHED_BOUNDS[k]) for k in CLASSES}
        classes = _classes(cfg["classes"], tables, f"{where}.classes")
        return DirectionRule(kind, None, {f: values[c] for f, c in classes.items()}, classes, scale, schedule,
                             control, nominal=values["base"])
    if "eb" not in present:
        raise ValueError(f"{where}: give eb (one bound) or classes (+ bounds)")
    eb = _number(cfg, "eb", where)
    return DirectionRule(kind, eb, {t.feature: eb for t in tables}, {}, scale, schedule, control, nominal=eb)


def build_policy(cfg: Mapping[str, Any], tables: Sequence[TableStats],
                 modes: Mapping[str, str] | None = None) -> Policy:
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
            raise ValueError(f"policy.{d}: the closed loop estimates value ranges from relative bounds; "
                             f"compression.{d}.mode is abs (use mode: rel)")
    return Policy(str(cfg.get("name", "policy")), rules)


__all__ = ["plain_config", "check_keys", "TableStats", "Policy", "DirectionRule", "Schedule", "Control", "build_policy", "schedule_multiplier",
           "published_classes", "automatic_classes", "control_update", "feature_index", "PUBLISHED_TABLES",
           "PUBLISHED_BOUNDS", "PUBLISHED_C", "PUBLISHED_EARLY_STAGE", "DIRECTIONS", "KINDS", "SCHEDULES"]
