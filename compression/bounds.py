"""Relative-to-range error bounds (the mode of Feng et al.): eb = rel * (max - min) per block."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import check_input, resolve_blocks


def relative_to_absolute(
    x: torch.Tensor, rel: float | Sequence[float] | torch.Tensor, blocks: Sequence[int] | None = None
) -> list[float]:
    """Absolute bound per column block: ``rel`` times the block's finite value range.

    Non-finite values are left out of the range; an empty or constant block gets bound 0 (its
    values are then sent exactly).
    """
    check_input(x)
    widths = resolve_blocks(x.shape[1], rel, None, blocks)
    if isinstance(rel, torch.Tensor):
        rel = rel.detach().cpu().double().reshape(-1).tolist() if rel.dim() else float(rel)
    rels = [float(rel)] * len(widths) if isinstance(rel, (int, float)) else [float(r) for r in rel]
    if len(rels) != len(widths):
        raise ValueError(f"{len(rels)} relative bounds for {len(widths)} blocks {widths}")
    if any(not r >= 0 for r in rels):
        raise ValueError(f"relative bounds must be >= 0, got {rels}")
    if x.numel() == 0:
        return [0.0] * len(widths)
    xf = x.float()
    finite = torch.isfinite(xf)
    hi = torch.where(finite, xf, float("-inf")).amax(dim=0)  # per column
    lo = torch.where(finite, xf, float("inf")).amin(dim=0)
    starts = torch.tensor([0, *widths[:-1]]).cumsum(0).tolist()
    out = []
    for r, s, w in zip(rels, starts, widths, strict=True):
        top, bottom = (hi[s : s + w].max().item(), lo[s : s + w].min().item()) if w else (0.0, 0.0)
        span = top - bottom if top >= bottom else 0.0  # no finite value: empty range
        out.append(r * span)
    return out
