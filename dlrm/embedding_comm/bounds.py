"""Error-bound policy seam: ``bound_fn(feature, direction, iteration) -> float`` per table block.

The dist asks the policy once per feature, direction and call; adaptive policies (table-wise,
iteration-wise, dual) plug in as another callable with the same signature. In ``rel`` mode the
policy's value is a fraction of the block's value range in the chunk being sent (gradients: the rows
as produced, before duplicate-id rows are summed).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

BoundFn = Callable[[str, str, int], float]
Bounds = list[float] | torch.Tensor  # absolute, per block: policy values (abs), or on the chunk's device (rel)


class fixed_bound:
    """The same bound for every feature, direction and iteration (a class, not a closure: a
    sharder holding it can be pickled)."""

    def __init__(self, eb: float) -> None:
        self.eb = float(eb)

    def __call__(self, feature: str, direction: str, iteration: int) -> float:
        return self.eb

    def __repr__(self) -> str:
        return f"fixed_bound({self.eb})"


def policy_values(bound_fn: BoundFn, features: Sequence[str], direction: str, iteration: int) -> list[float]:
    """Ask the policy for each feature; reject values the codec could not honour."""
    out = []
    for f in features:
        v = float(bound_fn(f, direction, iteration))
        if not (v >= 0.0 and math.isfinite(v)):
            raise ValueError(
                f"bound policy returned {v} for feature {f!r} ({direction}, iteration "
                f"{iteration}); a bound must be finite and >= 0"
            )
        out.append(v)
    return out


def absolute_bounds(x: torch.Tensor, widths: Sequence[int], values: Sequence[float], mode: str) -> Bounds:
    """Per-block absolute bounds of a chunk: the policy values, times the block's finite value
    range in rel mode (the compressor's own definition; a constant block gets 0, sent exactly),
    then a float64 tensor on the chunk's device that the codec takes without a host wait."""
    if mode == "abs":
        return list(values)
    from dlrm_compression import relative_to_absolute

    return relative_to_absolute(x, list(values), list(widths))


def host_bounds(bounds: Bounds | None) -> list[float] | None:
    """The bounds as Python floats, for the paths that read them on the host (sampling, the
    calibration of compression=auto): one host wait, not per chunk."""
    if bounds is None or isinstance(bounds, list):
        return bounds
    return [float(b) for b in bounds.tolist()]
