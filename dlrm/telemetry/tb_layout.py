"""TensorBoard custom-scalars layout: accuracy beside compression ratios, and per-table bounds/ratios.

Tag naming (the same as ``dlrm.embedding_comm.stats`` writes, direction first): ``comm/<direction>/ratio``
(whole direction), ``comm/<direction>/ratio/<feature>`` and ``comm/<direction>/max_abs_error/
<feature>`` per table, and ``comm/<direction>/eb/<feature>`` for the policy's bound per table
(:func:`policy_scalars`). The trainer calls :func:`add_layout` once on rank 0's writer.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from dlrm_compression.policies import DIRECTIONS, Policy


def eb_tag(direction: str, feature: str) -> str:
    """Tag of a table's error bound (the policy's value: relative or absolute per the codec mode)."""
    return f"comm/{direction}/eb/{feature}"


def ratio_tag(direction: str, feature: str) -> str:
    """Tag of a table's sampled compression ratio (written by ``dlrm.embedding_comm.comm_stats``)."""
    return f"comm/{direction}/ratio/{feature}"


def policy_scalars(
    policy: Policy, iteration: int, features: Sequence[str], directions: Sequence[str] = DIRECTIONS
) -> dict[str, float]:
    """Each table's current bound per direction, as ``comm/<direction>/eb/<feature>`` scalars."""
    return {eb_tag(d, f): policy.bound(f, d, iteration) for d in directions for f in features}


def _exact(tag: str) -> str:
    return f"^{re.escape(tag)}$"  # a chart tag is a regex; anchor whole-direction tags


def _per_table(direction: str, what: str) -> str:
    return f"^comm/{direction}/{what}/.+$"


def custom_scalars_layout(directions: Sequence[str] = DIRECTIONS) -> dict[str, dict[str, list[Any]]]:
    """The layout for ``SummaryWriter.add_custom_scalars``: {category: {chart: ["Multiline", [regex]]}}.

    First category: eval/test AUC and the compression ratios side by side (plus loss and the
    worst error/bound), then each direction's bound per table (an adaptive policy's bounds over
    the iterations, beside the validation AUC that moves them); then one category per direction
    with every table's bound, ratio and error.
    """
    layout: dict[str, dict[str, list[Any]]] = {
        "accuracy vs compression": {
            "AUC": ["Multiline", [_exact("eval/auc"), _exact("test/auc")]],
            "compression ratio (raw / wire bytes)": [
                "Multiline",
                [_exact(f"comm/{d}/ratio") for d in directions] + [_exact("comm/dense/ratio")],
            ],
            "log loss": ["Multiline", [_exact("train/loss"), _exact("eval/logloss")]],
            "max error / bound (<= 1)": ["Multiline", [_exact(f"comm/{d}/max_error_over_bound") for d in directions]],
            **{f"{d} bound per table (policy)": ["Multiline", [_per_table(d, "eb")]] for d in directions},
        },
    }
    layout["dense gradients"] = {
        "kept fraction (DCT)": ["Multiline", [_exact("comm/dense/keep")]],
        "threshold (DCT, largest)": ["Multiline", [_exact("comm/dense/threshold")]],
        "residual norm (DCT, largest rank)": ["Multiline", [_exact("comm/dense/residual_norm")]],
        "milliseconds (codec, launch to arrival)": [
            "Multiline",
            [_exact("comm/dense/codec_ms"), _exact("comm/dense/comm_ms")],
        ],
    }
    for d in directions:
        layout[f"{d} per table"] = {
            "error bound (policy)": ["Multiline", [_per_table(d, "eb")]],
            "compression ratio (sampled)": ["Multiline", [_per_table(d, "ratio")]],
            "max abs error (sampled)": ["Multiline", [_per_table(d, "max_abs_error")]],
        }
    return layout


def add_layout(writer: Any, directions: Sequence[str] = DIRECTIONS) -> None:
    """Write the layout into a ``torch.utils.tensorboard.SummaryWriter`` (rank 0, once per run)."""
    writer.add_custom_scalars(custom_scalars_layout(directions))


__all__ = ["add_layout", "custom_scalars_layout", "eb_tag", "policy_scalars", "ratio_tag"]
