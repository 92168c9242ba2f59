"""``compression=auto`` / ``dense_comm=auto`` as a component: the controller that calibrates,
decides and replays a strategy (inactive, and absent from checkpoints, otherwise)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from dlrm.dense_comm.component import DenseCommunication
from dlrm.embedding_comm.component import EmbeddingCompression
from dlrm.process.env import DistEnv
from dlrm.strategy.config import parse_strategy_cfg
from dlrm.strategy.controller import StrategyController
from dlrm.trainer.component import Component
from dlrm.trainer.loop import TrainState


class Strategy(Component):
    def __init__(
        self,
        env: DistEnv,
        compression: EmbeddingCompression,
        dense: DenseCommunication,
        run_dir: Path,
        text: Callable[[str, str], None] | None,
    ) -> None:
        spec = compression.spec
        self.controller = StrategyController(
            parse_strategy_cfg(spec.strategy, spec.strategy_file),
            env,
            compression.runtime if spec.auto else None,
            dense.dense if dense.dense.spec.name == "auto" else None,
            run_dir,
            text,
        )
        self.active: StrategyController | None = self.controller if self.controller.active else None

    @property
    def parts(self) -> Mapping[str, Stateful]:
        return {"strategy": self.controller} if self.active else {}

    def metrics(self, model: torch.nn.Module, state: TrainState) -> dict[str, Any]:
        return self.controller.metrics()

    def close(self) -> None:
        self.controller.close()
