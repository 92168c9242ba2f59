"""Error-bound policies: the bound each table gets, per direction and training iteration.

The compressed all-to-all asks ``bound_fn(feature, direction, iteration) -> float`` for every
table block it sends; a :class:`Policy` is such a callable, composed of one :class:`DirectionRule`
per direction (the trainer builds them from the ``policy`` config group in ``dlrm/embedding_comm/policy.py``).
The value is read in the compression config's mode for that direction (``rel``: a fraction of the
block's value range in the chunk; ``abs``: the bound itself).

Kinds (each direction has its own): ``fixed`` (one bound), ``table_wise`` (tight/base/loose
classes of tables), ``iteration_wise`` (a multiplier schedule over the early stage), ``dual``
(table-wise x iteration-wise, the published method of Feng et al., SC'24, arXiv 2407.04272:
rules in ``PUBLISHED_*`` below, from the authors' artifact ``allenfengjr/dlrm_comp``), and
``closed_loop`` (ours: any of the above, then corrected per table from measured errors; see
:class:`Control`). Any kind may also take a ``plateau`` (ours: its bounds tighten as validation AUC
flattens, :class:`Plateau`), a ``window`` of iterations outside which it sends exactly, and
``evaluation: exact`` (validation and test forwards sent exactly): the last two take a part of
the compression away, to find where its accuracy goes. The rules are plain functions
(:func:`schedule_multiplier`, :func:`published_classes`, :func:`automatic_classes`,
:func:`control_update`, :func:`plateau_update`, the last two in :mod:`compression.feedback`) that
the policy composes, so each is checked on its own.

Pure Python on plain values: no torch, torchrec, dlrm, omegaconf or config parsing; tables are
named by whatever the caller calls them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from .feedback import Control, Plateau, PlateauState, control_update, plateau_update

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


@dataclass(frozen=True)
class TableStats:
    """What a policy may know about a table: its feature name and size, optionally measured values.

    ``column``: its Criteo categorical column (C1 = 0), which the published class lists name;
    ``value_range``: max - min of its embedding values (e.g. of a sample of pooled rows);
    ``dedup_ratio``: rows / unique rows in a typical batch (>= 1; high for small, hot tables).
    """

    feature: str
    num_embeddings: int
    dim: int
    column: int | None = None
    value_range: float | None = None
    dedup_ratio: float | None = None


# ---------------------------------------------------------------------------------------------
# Iteration-wise: multiplier schedules (stage_check of the artifact)


def schedule_multiplier(
    kind: str, iteration: int, early_stage: int = PUBLISHED_EARLY_STAGE, c: float = PUBLISHED_C
) -> float:
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


def published_classes(dataset: str, tables: Sequence[TableStats]) -> dict[str, str]:
    """Class of each table under the published hard-coded lists (``kaggle`` or ``terabyte``),
    which name Criteo columns: every table needs its ``column``."""
    if dataset not in PUBLISHED_TABLES:
        raise ValueError(f"published table lists exist for {sorted(PUBLISHED_TABLES)}, got {dataset!r}")
    lists = PUBLISHED_TABLES[dataset]
    out = {}
    for t in tables:
        i = t.column
        if i is None:
            raise ValueError(
                f"table {t.feature!r} has no Criteo column; the published table lists name "
                "Criteo's categorical columns C1..C26"
            )
        if not 0 <= i < PUBLISHED_NUM_TABLES:
            raise ValueError(f"table {t.feature!r}: column {i} outside the {PUBLISHED_NUM_TABLES} Criteo tables")
        out[t.feature] = "tight" if i in lists["tight"] else "loose" if i in lists["loose"] else "base"
    return out


RANK_BY = ("num_embeddings", "value_range", "dedup_ratio")
SPLITS = ("proportion", "quantile", "threshold")


def _tightness(t: TableStats, rank_by: str) -> float:
    """Higher = tighter bound: many rows, a wide range, or few duplicates per batch."""
    if rank_by == "num_embeddings":
        return float(t.num_embeddings)
    value = getattr(t, rank_by)
    if value is None:
        raise ValueError(
            f"table {t.feature!r} has no measured {rank_by}; classes ranked by {rank_by} need it in every TableStats"
        )
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"table {t.feature!r}: {rank_by} must be finite and > 0, got {value}")
    return float(value) if rank_by == "value_range" else 1.0 / float(value)


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default) of an ascending list."""
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (pos - lo) * (sorted_values[hi] - sorted_values[lo])


def automatic_classes(
    tables: Sequence[TableStats],
    rank_by: str = "num_embeddings",
    split: str = "proportion",
    tight: float = KAGGLE_TIGHT_FRACTION,
    loose: float = KAGGLE_LOOSE_FRACTION,
) -> dict[str, str]:
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
            # _tightness (above) rejected a missing dedup_ratio
            is_tight = {t.feature: cast(float, t.dedup_ratio) <= tight for t in tables}
            is_loose = {t.feature: cast(float, t.dedup_ratio) >= loose for t in tables}
        else:
            is_tight = {f: s >= tight for f, s in score.items()}
            is_loose = {f: s <= loose for f, s in score.items()}
        if any(is_tight[f] and is_loose[f] for f in names):
            raise ValueError(f"classes thresholds overlap (tight {tight}, loose {loose}): a table would be both")
        return {f: "tight" if is_tight[f] else "loose" if is_loose[f] else "base" for f in names}
    if not (0 <= tight <= 1 and 0 <= loose <= 1 and tight + loose <= 1):
        raise ValueError(
            f"classes.tight and classes.loose are fractions of the tables summing to <= 1, got {tight} and {loose}"
        )
    if split == "proportion":
        order = sorted(range(n), key=lambda i: (-score[names[i]], i))  # biggest first, stable
        n_tight, n_loose = round(n * tight), round(n * loose)
        n_loose = min(n_loose, n - n_tight)
        out = {f: "base" for f in names}
        for i in order[:n_tight]:
            out[names[i]] = "tight"
        for i in order[n - n_loose :]:
            out[names[i]] = "loose"
        return out
    values = sorted(score.values())
    hi, lo = _quantile(values, 1 - tight), _quantile(values, loose)
    return {
        f: "tight" if tight > 0 and s >= hi else "loose" if loose > 0 and s <= lo else "base" for f, s in score.items()
    }


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
    plateau: Plateau | None = None
    level: PlateauState = field(default_factory=PlateauState)
    window: tuple[int, int | None] | None = None  # [start, end): compressed there, exact elsewhere
    evaluation: str = "train"  # train: evaluation forwards use the training bound | exact: bound 0

    def static(self, feature: str) -> float:
        """The table's bound before schedule and clamping: base x scale x closed-loop gain."""
        base = self.tables.get(feature, self.default)
        if base is None:
            raise KeyError(f"no error bound for feature {feature!r}: the policy knows the tables {sorted(self.tables)}")
        return base * self.scale * self.gains.get(feature, 1.0)

    def bound(self, feature: str, iteration: int, training: bool = True) -> float:
        if not training and self.evaluation == "exact":
            return 0.0
        if self.window is not None and not (
            self.window[0] <= iteration and (self.window[1] is None or iteration < self.window[1])
        ):
            return 0.0
        value = self.static(feature) * (self.schedule(iteration) if self.schedule else 1.0)
        if self.control is not None:
            value = min(max(value, self.control.min), self.control.max)
        return value * self.level.level


class Policy:
    """``bound(feature, direction, iteration) -> float`` (also ``policy(...)``), one rule per direction."""

    def __init__(self, name: str, rules: Mapping[str, DirectionRule]) -> None:
        missing = [d for d in DIRECTIONS if d not in rules]
        if missing:
            raise ValueError(f"policy {name!r} has no rule for {missing}")
        self.name = name
        self.rules = dict(rules)
        self._window_start = 0  # iteration of the previous observe()

    def bound(self, feature: str, direction: str, iteration: int, training: bool = True) -> float:
        """The bound for ``feature``'s block in ``direction`` at training ``iteration`` (``training``
        False: an evaluation pass's forward)."""
        rule = self.rules.get(direction)
        if rule is None:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        return rule.bound(feature, int(iteration), training)

    __call__ = bound  # a Policy is a dlrm.embedding_comm BoundFn

    def bounds(self, direction: str, iteration: int, features: Sequence[str] | None = None) -> dict[str, float]:
        """Every known (or given) table's bound at ``iteration``, e.g. for TensorBoard."""
        rule = self.rules[direction]
        return {f: rule.bound(f, iteration) for f in (features if features is not None else sorted(rule.tables))}

    def observe(self, iteration: int, errors: Mapping[str, Mapping[str, float]]) -> None:
        """Feed the sampled max abs error of each table in the window ending at ``iteration``,
        ``{direction: {feature: error}}``; only ``closed_loop`` rules react (a direction or table
        without a sample keeps its bounds)."""
        start, self._window_start = self._window_start, int(iteration)
        for d, rule in self.rules.items():
            measured = errors.get(d, {})
            if rule.control is None or not measured:
                continue
            # the schedule only decays: its largest value in the window is at one of its ends (+-1
            # for the pipeline's one-batch lead)
            sched = rule.schedule.max_over(start - 1, int(iteration) + 1) if rule.schedule else 1.0
            used, known = {}, {}
            for f in measured:
                try:
                    s = rule.static(f)
                except KeyError:
                    continue  # a table this rule has no entry for: nothing to correct
                known[f] = s
                used[f] = min(max(s * sched, rule.control.min), rule.control.max)
            control = rule.control
            if rule.scale != 1.0:  # `scale` is the one knob of every kind: here it scales the target
                control = Control(control.target * rule.scale, control.min, control.max, control.gain, control.max_step)
            new = control_update(used, measured, control)
            for f, s in known.items():
                if new[f] != used[f]:
                    # divide the schedule back out: the gain corrects the table, the schedule stays
                    rule.gains[f] = rule.gains.get(f, 1.0) * (new[f] / sched) / s

    def validated(self, auc: float | None) -> dict[str, float]:
        """Feed a validation pass's AUC to the ``plateau`` rules; their levels after it, per direction."""
        out = {}
        for d, rule in self.rules.items():
            if rule.plateau is not None:
                rule.level = plateau_update(rule.level, auc, rule.plateau)
                out[d] = rule.level.level
        return out

    @property
    def closed_loop(self) -> list[str]:
        """The directions whose rule reacts to :meth:`observe`."""
        return [d for d, r in self.rules.items() if r.control is not None]

    def state_dict(self) -> dict[str, Any]:
        """Closed-loop state to checkpoint (gains per direction and table, last observed iteration)."""
        return {
            "gains": {d: dict(r.gains) for d, r in self.rules.items()},
            "window_start": self._window_start,
            "plateau": {d: vars(r.level).copy() for d, r in self.rules.items() if r.plateau is not None},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (on resume, so a closed loop continues where it was)."""
        for d, gains in state.get("gains", {}).items():
            if d not in self.rules:
                raise ValueError(f"policy state names direction {d!r}; the policy has {sorted(self.rules)}")
            self.rules[d].gains = {str(f): float(g) for f, g in gains.items()}
        self._window_start = int(state.get("window_start", 0))
        for d, level in state.get("plateau", {}).items():
            if d not in self.rules or self.rules[d].plateau is None:
                raise ValueError(f"policy state has a plateau level for {d!r}; this policy has no plateau there")
            self.rules[d].level = PlateauState(float(level["level"]), level["best"], int(level["flat"]))

    def summary(self) -> dict[str, Any]:
        """Flat keys for metrics.json: the policy name and each direction's kind and base bound."""
        out: dict[str, Any] = {"policy": self.name}
        for d, r in self.rules.items():
            out[f"policy_{d}_kind"] = r.kind
            # the level a sweep varies: the base bound, or the closed loop's error target
            out[f"policy_{d}_bound"] = (r.control.target if r.control else r.nominal) * r.scale
            if r.plateau is not None:
                out[f"policy_{d}_level"] = r.level.level  # the plateau's multiplier at the end
        return out

    def __repr__(self) -> str:
        return f"Policy({self.name!r}, " + ", ".join(f"{d}={r.kind}" for d, r in self.rules.items()) + ")"


__all__ = [
    "CLASSES",
    "DIRECTIONS",
    "KINDS",
    "PUBLISHED_BOUNDS",
    "PUBLISHED_C",
    "PUBLISHED_EARLY_STAGE",
    "PUBLISHED_TABLES",
    "SCHEDULES",
    "Control",
    "DirectionRule",
    "Plateau",
    "PlateauState",
    "Policy",
    "Schedule",
    "TableStats",
    "automatic_classes",
    "control_update",
    "plateau_update",
    "published_classes",
    "schedule_multiplier",
]
