"""TensorBoard on rank 0 only; every other rank gets a logger that does nothing."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter

from dlrm.telemetry.tb_layout import add_layout

# The final metrics beside the config in the HPARAMS view (as hparam/<key>).
HPARAM_METRICS = ("auc", "logloss", "forward_ratio", "backward_ratio", "dense_ratio")


class TensorBoardLogger:
    def __init__(self, log_dir: Path | None) -> None:
        self.writer = SummaryWriter(log_dir=str(log_dir)) if log_dir is not None else None
        if self.writer is not None:
            add_layout(self.writer)  # accuracy beside compression ratio in the CUSTOM SCALARS tab

    def scalars(self, values: Mapping[str, float | None], step: int) -> None:
        """Each value as a scalar; None (an undefined metric, e.g. AUC of one class) is left out."""
        if self.writer is None:
            return
        for tag, value in values.items():
            if value is not None:
                self.writer.add_scalar(tag, value, step)

    def text(self, tag: str, value: str) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, value)

    def hparams(self, hparams: Mapping[str, Any], metrics: Mapping[str, float | None]) -> None:
        """The run's config beside its final metrics (those defined), so runs compare in the HPARAMS view."""
        if self.writer is None:
            return
        clean = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in hparams.items()}
        self.writer.add_hparams(clean, {k: v for k, v in metrics.items() if v is not None}, run_name=".")

    def final(self, metrics: Mapping[str, Any], step: int, hparams: Mapping[str, Any]) -> None:
        """The test metrics as scalars, the config beside the final metrics (HPARAMS), then close."""
        self.scalars({f"test/{k}": metrics[k] for k in ("auc", "logloss", "accuracy")}, step)
        self.hparams(hparams, {f"hparam/{k}": metrics[k] for k in HPARAM_METRICS})
        self.close()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
