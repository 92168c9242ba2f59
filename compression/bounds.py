"""Relative-to-range error bounds (the mode of Feng et al.): eb = rel * (max - min) per block.

Computed on the tensor's device as one segmented reduction, with no host synchronisation: the
bounds come back as a float64 tensor that the lossy codec takes as it is (a Python number taken
from a device tensor would stall the device once per block).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import ops
from .backend import upload
from .base import check_input, resolve_blocks


def relative_to_absolute(
    x: torch.Tensor, rel: float | Sequence[float] | torch.Tensor, blocks: Sequence[int] | None = None
) -> torch.Tensor:
    """Absolute bound per column block (float64 ``[n_blocks]`` on ``x``'s device): ``rel`` times
    the block's finite value range.

    Non-finite values are left out of the range; an empty or constant block gets bound 0 (its
    values are then sent exactly). The range is taken in float32 and widened to float64 before
    the subtraction, as Python floats of the block's max and min would be.
    """
    check_input(x)
    widths = resolve_blocks(x.shape[1], rel, None, blocks)
    rels = _relative(rel, len(widths), x.device)
    return ops.relative_bounds(x, rels, widths)  # one op: the ranges of every block


def _relative(rel: float | Sequence[float] | torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """The relative bounds as float64 ``[n]`` on ``device``; host values are checked on the host,
    a tensor's on its device (an asynchronous assert: no wait)."""
    if isinstance(rel, torch.Tensor):
        r = rel.detach().to(device=device, dtype=torch.float64).reshape(-1)
        if r.numel() == 1:
            r = r.expand(n)
        if r.numel() != n:
            raise ValueError(f"{r.numel()} relative bounds for {n} blocks")
        torch._assert_async((r >= 0).all(), "relative bounds must be >= 0")
        return r
    rels = [float(rel)] * n if isinstance(rel, (int, float)) else [float(r) for r in rel]
    if len(rels) != n:
        raise ValueError(f"{len(rels)} relative bounds for {n} blocks")
    if any(not r >= 0 for r in rels):
        raise ValueError(f"relative bounds must be >= 0, got {rels}")
    return upload(torch.tensor(rels, dtype=torch.float64), device)
