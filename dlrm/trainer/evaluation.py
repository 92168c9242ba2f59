"""Evaluation metrics synchronized across ranks (torchmetrics): AUC, log loss, accuracy."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torchmetrics
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC

log = logging.getLogger(__name__)


class LogLoss(torchmetrics.Metric):
    """Mean binary cross-entropy of sigmoid(logits); sums and counts reduce across ranks."""

    full_state_update = False
    total: torch.Tensor  # states registered by add_state
    count: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.double(), labels.double(), reduction="sum")
        self.total += loss
        self.count += labels.numel()

    def compute(self) -> torch.Tensor:
        return self.total / self.count.clamp(min=1)


class Evaluator:
    """AUROC, log loss and accuracy over one evaluation pass; ``compute`` syncs every rank."""

    def __init__(self, device: torch.device) -> None:
        self.auc = BinaryAUROC().to(device)
        self.accuracy = BinaryAccuracy().to(device)
        self.logloss = LogLoss().to(device)
        self.samples = torchmetrics.SumMetric().to(device)
        self.positives = torchmetrics.SumMetric().to(device)

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        labels = labels.float()
        probs = torch.sigmoid(logits.float())
        self.auc.update(probs, labels.long())
        self.accuracy.update(probs, labels.long())
        self.logloss.update(logits, labels)
        self.samples.update(torch.tensor(float(labels.numel()), device=labels.device))
        self.positives.update(labels.sum().double())

    def compute(self, split: str) -> dict[str, float | None]:
        """The metrics of the pass over ``split``; ``auc`` is None (with a warning) when the split
        holds one class only, where AUROC is undefined (torchmetrics would report 0.0)."""
        samples, positives = int(self.samples.compute()), int(self.positives.compute())
        one_class = positives in (0, samples)  # the same on every rank: the counts are synced
        if one_class and (not dist.is_initialized() or dist.get_rank() == 0):
            log.warning(
                "%s AUC is undefined: the split has %d positive and %d negative rows; it is null in "
                "metrics.json and not logged to TensorBoard",
                split,
                positives,
                samples - positives,
            )
        out = {
            "auc": None if one_class else float(self.auc.compute()),
            "logloss": float(self.logloss.compute()),
            "accuracy": float(self.accuracy.compute()),
            "samples": samples,
        }
        for metric in (self.auc, self.accuracy, self.logloss, self.samples, self.positives):
            metric.reset()
        return out
