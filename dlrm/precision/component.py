"""The ``precision`` group as a component: table and MLP dtypes, fused kernels at sharding time."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dlrm.precision.config import embedding_bytes_per_rank, parse_precision_cfg
from dlrm.process.env import DistEnv
from dlrm.trainer.component import Component, Sharding
from dlrm.trainer.loop import TrainState


class Precision(Component):
    def __init__(self, cfg: Mapping[str, Any]) -> None:
        self.spec = parse_precision_cfg(cfg)

    def model_options(self, env: DistEnv) -> dict[str, Any]:
        """The dtypes :func:`dlrm.trainer.model.build_model` builds the tables and MLPs in."""
        return {"data_type": self.spec.data_type, "dense_dtype": self.spec.dense_dtype, "device_type": env.device.type}

    def shard(self, sharding: Sharding) -> None:
        sharding.fused_only = self.spec.fused_only  # fp16 tables live in FBGEMM's fused kernel

    def metrics(self, model: torch.nn.Module, state: TrainState) -> dict[str, Any]:
        return {
            "precision": {"embeddings": self.spec.embeddings, "dense": self.spec.dense},
            "embedding_bytes_per_rank": embedding_bytes_per_rank(model),
        }
