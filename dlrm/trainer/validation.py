"""The validation passes of a run and its test pass: what the loop does when an evaluation is due.

Every pass's metrics go to ``report`` (TensorBoard) and the log; with early stopping each pass is
also told to :class:`~dlrm.trainer.early_stopping.EarlyStopping`, the best step's checkpoint is kept
(``best``), and the test pass runs on its weights.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from dlrm.process.env import DistEnv
from dlrm.trainer.checkpoint import Checkpointer
from dlrm.trainer.early_stopping import EarlyStopping
from dlrm.trainer.loop import TrainState, evaluate, take

log = logging.getLogger("dlrm.train")


class Validation:
    """Validation passes on ``batches()`` (at most ``limit`` batches), the last one's metrics kept."""

    def __init__(
        self,
        model: torch.nn.Module,
        env: DistEnv,
        batches: Callable[[], Iterable[Any]],
        limit: int | None,
        stopping: EarlyStopping | None,
        best: Checkpointer,
        report: Callable[[Mapping[str, float | None], int], None],
    ) -> None:
        self.model, self.env, self.batches, self.limit = model, env, batches, limit
        self.stopping, self.best, self.report = stopping, best, report
        self.last: dict[str, Any] = {}

    def run(self, s: TrainState) -> None:
        """One validation pass at ``s``'s iteration; the best step's checkpoint saved when it is one."""
        self.last = dict(evaluate(self.model, take(iter(self.batches()), self.limit), self.env.device, "val"))
        self.report({f"eval/{k}": v for k, v in self.last.items() if k != "samples"}, s.iteration)
        if self.env.is_main:
            log.info("iteration %d: val %s", s.iteration, self.last)
        if self.stopping and self.stopping.observe(self.last["auc"], s.iteration):
            self.best.save(s)  # the best step's checkpoint, tested at the end

    @property
    def stopped(self) -> bool:
        return bool(self.stopping and self.stopping.stopped)

    def test(self, batches: Iterable[Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The test pass (on the best validation step's weights where early stopping saved one)
        and early stopping's metrics."""
        extra = {}
        if self.stopping:
            extra = self.stopping.metrics(tested_on_best=self.best.load_weights() is not None)
        return dict(evaluate(self.model, batches, self.env.device, "test")), extra
