"""Telemetry as a component: TensorBoard, the console progress (and losses.txt), the wire meter
and the host-synchronisation meter watching training steps, and at the end the measured and
predicted wire bytes (with the hot-row replicas' figures, which the prediction prices) and the host
synchronisations per iteration."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from dlrm.dense_comm.component import DenseCommunication
from dlrm.embedding_comm.component import EmbeddingCompression
from dlrm.embedding_comm.policy import bounded_directions
from dlrm.placement.comm_aware import log_plan
from dlrm.placement.component import Placement
from dlrm.process.env import DistEnv
from dlrm.strategy.controller import StrategyController
from dlrm.telemetry.host_syncs import HostSyncMeter
from dlrm.telemetry.progress import Progress
from dlrm.telemetry.tb_logger import TensorBoardLogger
from dlrm.telemetry.wire import WireMeter, placements, wire_metrics
from dlrm.trainer.component import Component
from dlrm.trainer.datasets import RunData
from dlrm.trainer.loop import StepObserver, TrainState
from dlrm.trainer.model import table_names
from dlrm.trainer.optim import WarmupDecayLR
from dlrm.trainer.sharding import describe_plan

log = logging.getLogger("dlrm.train")


class Telemetry(Component):
    def __init__(
        self,
        cfg: DictConfig,
        env: DistEnv,
        run_dir: Any,
        model: torch.nn.Module,
        data: RunData,
        compression: EmbeddingCompression,
        dense: DenseCommunication,
        placement: Placement,
    ) -> None:
        self.cfg, self.env, self.run_dir, self.data = cfg, env, run_dir, data
        self.compression, self.dense, self.placement = compression, dense, placement
        dim = int(cfg.model.embedding_dim)
        self.tables = placements(model, dict(zip(table_names(data.features), data.num_embeddings, strict=True)), dim)
        if placement.traffic is not None and env.is_main:
            log_plan(self.tables, placement.traffic, placement.table_freqs)
        hot = placement.replication
        self.meter = WireMeter(
            sum(t.num_embeddings * t.dim for t in self.tables if t.kind == "data_parallel"),
            env.world_size,
            (lambda: hot.optimizer.sent_bytes) if hot else None,
        )
        self.syncs = HostSyncMeter(env.device)
        self.tb = TensorBoardLogger(run_dir / "tensorboard" if env.is_main else None)
        self.plan = describe_plan(model)
        if env.is_main:
            log.info("sharding plan: %s", self.plan)
            self.tb.text("config", f"```\n{OmegaConf.to_yaml(cfg)}\n```")
        self.text = self.tb.text if env.is_main else None  # for the strategy's decisions
        self.progress: Progress | None = None

    def start(
        self,
        model: torch.nn.Module,
        schedule: WarmupDecayLR,
        strategy: StrategyController | None,
        global_batch: int,
        total: int,
        start: int,
    ) -> Progress:
        """The progress of training from iteration ``start`` (after a resume) to ``total``."""
        cfg = self.cfg
        self.progress = Progress(
            self.env,
            model,
            schedule,
            self.tb,
            self.compression.policy,
            self.data.features,
            bounded=bounded_directions(self.compression.spec),
            dense=self.dense.dense,
            strategy=strategy,
            global_batch=global_batch,
            log_every=cfg.log_every,
            total=total,
            start=start,
            progress_bar=cfg.progress_bar,
            loss_log=self.run_dir / "losses.txt" if cfg.loss_log else None,
        )
        return self.progress

    @property
    def observers(self) -> list[StepObserver]:
        return [self.meter, self.syncs]

    def validated(self, values: Mapping[str, float | None], iteration: int) -> None:
        self.tb.scalars(values, iteration)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()

    def metrics(self, model: torch.nn.Module, state: TrainState) -> dict[str, Any]:
        """The wire bytes measured and predicted, the replicas' figures and the host
        synchronisations per iteration (collectives)."""
        hot = self.placement.replication
        hot_metrics = hot.metrics(self.meter.iterations) if hot else {}
        wire = wire_metrics(
            model,
            self.meter,
            self.compression.spec,
            self.tables,
            self.placement.table_freqs,
            self.env.world_size,
            state.rank_samples / max(self.meter.iterations, 1),  # the batch trained: a short last one included
            self.data.features,
            hot=hot.summary["tables"] if hot else None,
            sync=hot.sync_traffic(hot_metrics["hot_rows"]["sync_row_ratio"]) if hot else None,
        )
        if self.env.is_main and wire["wire_bytes_per_iteration"] is not None:
            log.info(
                "wire bytes per iteration (embedding path, all ranks): measured %.0f, predicted %.0f",
                wire["wire_bytes_per_iteration"],
                wire["predicted_wire_bytes_per_iteration"],
            )
        syncs = self.syncs.metrics()
        if self.env.is_main and syncs["host_syncs_per_iteration"] is not None:
            log.info("host synchronisations per iteration (each rank): %.1f", syncs["host_syncs_per_iteration"])
        return {"sharding_plan": self.plan, **wire, **hot_metrics, **syncs}
