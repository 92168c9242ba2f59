"""Early stopping on validation AUC: patience in evaluations, the best step's weights kept.

``early_stopping.patience`` > 0 turns it on: after every validation pass the trainer calls
:meth:`EarlyStopping.observe`; a pass whose AUC beats the best so far by more than ``min_delta`` (Keras's rule) is
the new best (the trainer saves its checkpoint under ``<checkpoint.dir>/best``), and ``patience``
passes in a row without one stop training. The state is a checkpoint part (the same on every rank:
the AUC is synchronised), so a resumed run keeps counting and a stopped run stays stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from dlrm.process.config_checks import check_keys, integer, number, plain_config

log = logging.getLogger(__name__)
KEYS = {"patience", "min_delta"}


class EarlyStopping:
    """Counts validation passes since the best AUC; ``stopped`` once ``patience`` passed without a better one."""

    def __init__(self, patience: int, min_delta: float = 0.0) -> None:
        self.patience, self.min_delta = patience, min_delta
        self.best_auc: float | None = None
        self.best_iteration: int | None = None
        self.since_best = 0  # validation passes since the best one
        self.stopped_iteration: int | None = None

    @classmethod
    def from_config(cls, cfg: Any) -> EarlyStopping | None:
        """The ``early_stopping`` section, validated (None when patience is 0: off)."""
        cfg = plain_config(cfg) or {}
        check_keys(cfg, KEYS, "early_stopping")
        patience = integer(cfg, "patience", "early_stopping", default=0)
        min_delta = number(cfg, "min_delta", "early_stopping", default=0.0)
        return cls(patience, min_delta) if patience else None

    @property
    def stopped(self) -> bool:
        return self.stopped_iteration is not None

    def observe(self, auc: float | None, iteration: int) -> bool:
        """Record the validation AUC of ``iteration``; True when it is the new best (save it).
        An undefined AUC (a validation split of one class) never improves."""
        if auc is not None and (self.best_auc is None or auc > self.best_auc + self.min_delta):
            self.best_auc, self.best_iteration, self.since_best = auc, iteration, 0
            return True
        self.since_best += 1
        if self.since_best >= self.patience:
            self.stopped_iteration = iteration
            log.info(
                "early stopping at iteration %d: validation AUC %s has not improved by %g for %d evaluations "
                "(best %s at iteration %s)",
                iteration,
                auc,
                self.min_delta,
                self.patience,
                self.best_auc,
                self.best_iteration,
            )
        return False

    def metrics(self, tested_on_best: bool) -> dict[str, Any]:
        """metrics.json's keys: the best validation pass, where training stopped (None: it ran to the
        end), and whose weights the test pass saw (``best``; ``final`` when no pass had an AUC)."""
        return {
            "best_val_auc": self.best_auc,
            "best_iteration": self.best_iteration,
            "stopped_iteration": self.stopped_iteration,
            "tested_on": "best" if tested_on_best else "final",
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "best_auc": self.best_auc,
            "best_iteration": self.best_iteration,
            "since_best": self.since_best,
            "stopped_iteration": self.stopped_iteration,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best_auc, self.best_iteration = state.get("best_auc"), state.get("best_iteration")
        self.since_best, self.stopped_iteration = int(state.get("since_best", 0)), state.get("stopped_iteration")
