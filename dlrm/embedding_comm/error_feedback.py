"""Error feedback on the backward all-to-all (``compression.backward.error_feedback``).

The error-bounded codec rounds every gradient entry to a bin of width ``2 eb``: an entry smaller
than ``eb`` arrives as 0, every time, so a rare id whose gradients are small never moves. With
error feedback the sender keeps what each sent row lost (its residual: the row as summed for the
id, minus what the owner decodes) and adds it to that id's row at its next send, as DCT does for
the dense gradients: what reaches the owner for an id over the run is the sum of its gradients to
within one bound, not one bound per send.

Residuals live on the sender, one ``[rows, width]`` table per (destination, column block), the
size of the table it feeds (allocated at its first send). The residual is computed without the
payload, by the quantiser's own arithmetic (:func:`compression.quantize.roundtrip`), so nothing
waits for the device. Needs ids and duplicate-id sums (``backward.dedup: true``): every row of an
id then carries the same sum, and the owner keeps one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dlrm.embedding_comm.stage import Outgoing, Stage
from dlrm_compression.quantize import roundtrip


def step_and_margin(bound: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantiser's float32 bin width ``2 eb`` and strict margin (<= eb) of one absolute bound,
    in the codec's roundings (:func:`compression.quantize.steps_and_margins`)."""
    b = torch.as_tensor(bound, dtype=torch.float64)
    e = b.float()
    ed = torch.where(e.double() > b, torch.nextafter(e, torch.full_like(e, -torch.inf)), e)
    return (2.0 * b).float(), ed


class ErrorFeedback(Stage):
    """The backward chunks' residuals, per destination rank and column block (a training stage)."""

    def __init__(self, num_embeddings: Mapping[str, int]) -> None:
        self.num_embeddings = dict(num_embeddings)
        self.residuals: dict[str, torch.Tensor] = {}  # "<dst>/<block>" -> [rows of its table, width]

    def reads_ids(self, direction: str) -> bool:
        return direction == "backward"

    def _residual(self, key: str, feature: str, width: int, like: torch.Tensor) -> torch.Tensor:
        r = self.residuals.get(key)
        if r is None:
            if feature not in self.num_embeddings:
                raise KeyError(f"error feedback: no table size for feature {feature!r}")
            r = self.residuals[key] = torch.zeros(
                self.num_embeddings[feature], width, dtype=like.dtype, device=like.device
            )
        return r

    def before_encode(self, c: Outgoing) -> None:
        if c.direction != "backward" or c.ids is None or c.bounds is None or not c.dc.dedup:
            return
        chunk, start = c.chunk.clone(), 0
        for k, (feature, width) in enumerate(zip(c.blocks.features, c.blocks.widths, strict=True)):
            if width:
                ids = c.ids[:, k]
                r = self._residual(f"{c.dst}/{k}", feature, width, chunk)
                block = chunk[:, start : start + width] + r[ids]
                step, ed = step_and_margin(c.bounds[k])
                held = roundtrip(block.reshape(-1), step.to(block.device), ed.to(block.device)).view_as(block)
                r[ids] = block - held  # an id's rows are equal (summed): any of them writes the same
                chunk[:, start : start + width] = block
            start += width
        c.chunk = chunk

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": dict(self.residuals)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.residuals = {str(k): v for k, v in state.get("residuals", {}).items()}
