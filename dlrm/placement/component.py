"""The ``placement`` group as a component: id statistics, the comm_aware planner at sharding time,
and hot-row replication once the model is sharded (replicas, their optimizer, the batch split)."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from omegaconf import DictConfig
from torch.distributed.checkpoint.stateful import Stateful

from dlrm.dense_comm.component import DenseCommunication
from dlrm.embedding_comm.component import EmbeddingCompression
from dlrm.placement.codec_ratio import priced_directions
from dlrm.placement.comm_aware import build_planner
from dlrm.placement.config import parse_placement_cfg
from dlrm.placement.replication import Replication, setup_replication
from dlrm.placement.traffic import Direction
from dlrm.process.env import DistEnv
from dlrm.trainer.component import Component, Sharding
from dlrm.trainer.datasets import RunData
from dlrm.trainer.model import table_names


class Placement(Component):
    def __init__(
        self,
        cfg: DictConfig,
        env: DistEnv,
        data: RunData,
        compression: EmbeddingCompression,
        dense: DenseCommunication,
    ) -> None:
        self.cfg, self.env, self.data, self.compression, self.dense = cfg, env, data, compression, dense
        self.spec = parse_placement_cfg(cfg.placement, cfg.sharding.type, len(data.features))
        # id statistics, for the traffic model and hot-row replication
        self.freqs, _ = data.frequency(cfg.batch_size, self.spec.estimate_batches, self.spec.top_n)
        self.table_freqs = dict(zip(table_names(data.features), self.freqs, strict=True))
        self.traffic: Any = None  # comm_aware's traffic model
        self.replication: Replication | None = None

    def shard(self, sharding: Sharding) -> None:
        if self.cfg.sharding.type != "comm_aware":
            return
        sharding.planner, self.traffic = build_planner(
            self.env,
            self.cfg.sharding,
            self.spec,
            self.compression.spec,
            self.directions,
            self.dense.dense.spec.hooked,
            self.data.features,
            self.freqs,
            self.cfg.batch_size,
            int(self.cfg.model.embedding_dim),
            fused_only=sharding.fused_only,
        )

    def replicate(self, model: torch.nn.Module) -> None:
        """Replicate the hot rows in the sharded ``model`` (placement.hot_rows; none: nothing)."""
        runtime = self.compression.runtime
        self.replication = setup_replication(
            self.spec,
            model,
            self.data.features,
            self.freqs,
            self.cfg.optimizer,
            self.compression.spec,
            self.cfg.batch_size,
            int(self.cfg.model.embedding_dim),
            runtime=runtime,
            directions=self.directions if self.spec.replicates else None,
        )

    @functools.cached_property
    def directions(self) -> tuple[Direction, Direction]:
        """The all-to-alls as the traffic model prices them, measured once for the planner and the
        hot rows (a calibration encode of our codecs, or TorchRec's QComms codec on rows)."""
        c = self.compression
        dim = int(self.cfg.model.embedding_dim)
        return priced_directions(
            c.spec, c.runtime, self.data.features, self.freqs, self.cfg.batch_size, dim, self.cfg.seed
        )

    @property
    def optimizers(self) -> list[Any]:
        """Optimizers beside the model's own (the replicas')."""
        return [self.replication.optimizer] if self.replication else []

    def split(self, batches: Iterable[Any]) -> Iterable[Any]:
        """``batches`` with the hot ids split off when rows are replicated."""
        return self.replication.split.batches(batches) if self.replication else batches

    @property
    def parts(self) -> Mapping[str, Stateful]:
        return {"hot_rows": self.replication} if self.replication else {}
