"""The error-bound policies' feedback rules (ours, opt-in): the closed loop, which corrects each
table's bound from the sampled compression errors, and the plateau, which tightens the bounds as
validation AUC flattens. Plain functions on plain values, composed by
:class:`compression.policies.Policy` (the same rules as its others: no torch, no config parsing).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass

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
    ranges = {
        f: errors[f] / b
        for f, b in bounds.items()
        if f in errors and b > 0 and math.isfinite(errors[f]) and errors[f] > 0
    }
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
# Plateau (ours, opt-in): the iteration-wise level driven by validation AUC


@dataclass(frozen=True)
class Plateau:
    """Bounds that tighten as validation AUC flattens: the iteration-wise level of the dual policy
    driven by the training signal instead of a fixed early stage (which a short run may never
    leave: the published 65,536 iterations are 21% of a Kaggle epoch, 270 of ours).

    After ``patience`` validation passes in a row whose AUC beats the best so far by less than
    ``min_delta``, the direction's bounds are multiplied by ``factor``, never below ``floor``
    times what they were (a level of 1 at the start)."""

    factor: float = 0.5
    min_delta: float = 0.001
    patience: int = 1
    floor: float = 0.125

    def __post_init__(self) -> None:
        if not 0 < self.factor < 1:
            raise ValueError(f"plateau.factor must be in (0, 1), got {self.factor}")
        if not (0 < self.floor <= 1):
            raise ValueError(f"plateau.floor must be in (0, 1], got {self.floor}")
        if not (self.min_delta >= 0 and math.isfinite(self.min_delta)):
            raise ValueError(f"plateau.min_delta must be finite and >= 0, got {self.min_delta}")
        if self.patience < 1:
            raise ValueError(f"plateau.patience must be >= 1, got {self.patience}")


@dataclass
class PlateauState:
    """Where a plateau rule stands: its level (multiplier of the bounds), the best AUC seen and the
    flat passes since the last improvement or tightening."""

    level: float = 1.0
    best: float | None = None
    flat: int = 0


def plateau_update(state: PlateauState, auc: float | None, plateau: Plateau) -> PlateauState:
    """The state after one validation pass of AUC ``auc`` (None, undefined: no information)."""
    if auc is None or not math.isfinite(auc):
        return state
    improved = state.best is None or auc >= state.best + plateau.min_delta
    best = auc if state.best is None else max(state.best, auc)
    flat = 0 if improved else state.flat + 1
    if flat < plateau.patience:
        return PlateauState(state.level, best, flat)
    return PlateauState(max(state.level * plateau.factor, plateau.floor), best, 0)
