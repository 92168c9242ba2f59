"""What follows every optimizer step: the progress bar, and every ``log_every``
iterations the TensorBoard scalars (loss, LR, throughput, comm statistics, policy bounds) and the
closed-loop policy's feedback; optionally every loss to ``losses.txt``."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from dlrm.dense_comm.hook import DenseComm
from dlrm.embedding_comm.policy import PolicyFeedback
from dlrm.process.env import DistEnv
from dlrm.process.timeout import named_collective
from dlrm.strategy.controller import StrategyController
from dlrm.telemetry.comm_stats import comm_stats_all_ranks
from dlrm.telemetry.tb_layout import policy_scalars
from dlrm.telemetry.tb_logger import TensorBoardLogger
from dlrm.trainer.loop import TrainState
from dlrm.trainer.optim import WarmupDecayLR
from dlrm_compression.policies import DIRECTIONS, Policy


class Progress:
    """Per-step bookkeeping of one run (every rank: the comm statistics are a collective)."""

    def __init__(
        self,
        env: DistEnv,
        model: torch.nn.Module,
        schedule: WarmupDecayLR,
        tb: TensorBoardLogger,
        policy: Policy | None,
        features: Sequence[str],
        *,
        bounded: Sequence[str] = DIRECTIONS,
        dense: DenseComm | None = None,
        strategy: StrategyController | None = None,
        global_batch: int,
        log_every: int,
        total: int,
        start: int,
        progress_bar: bool,
        loss_log: Path | None,
    ) -> None:
        self.env, self.model, self.schedule, self.tb = env, model, schedule, tb
        self.policy, self.features, self.dense = policy, list(features), dense
        self.bounded = list(bounded)  # the directions whose bounds are used (and logged)
        self.strategy = strategy
        self.feedback = PolicyFeedback(policy) if policy is not None else None
        self.global_batch, self.log_every = global_batch, log_every
        self.loss_log = loss_log if env.is_main else None
        self.bar = tqdm(total=total, initial=start, desc="train", disable=not (env.is_main and progress_bar))
        self.window_start, self.window_samples = time.perf_counter(), 0

    def step(self, state: TrainState, loss: torch.Tensor) -> None:
        """After iteration ``state.iteration`` (counted from 1), before the LR schedule moves on: its
        loss, the LR it trained with and the bounds its all-to-alls used are logged at that step."""
        lr = self.schedule.lr
        self.window_samples += self.global_batch
        self.bar.update(1)
        it = state.iteration
        if it % self.log_every == 0:
            now = time.perf_counter()
            self.tb.scalars(
                {
                    "train/loss": float(loss),
                    "train/lr": lr,
                    "train/samples_per_s": self.window_samples / max(now - self.window_start, 1e-9),
                },
                it,
            )
            with named_collective(f"the all-gather of comm statistics at iteration {it}"):
                comm = comm_stats_all_ranks(self.model, dense=self.dense)  # a collective: every rank logs
            self.tb.scalars(comm, it)
            if self.policy is not None and self.feedback is not None:
                # the bounds this iteration used (the dists count iterations from 0), before feedback
                self.tb.scalars(policy_scalars(self.policy, it - 1, self.features, self.bounded), it)
                self.feedback.observe(it, comm)  # the same merged stats on every rank: same bounds
            self.window_start, self.window_samples = now, 0
        if self.loss_log is not None:
            with open(self.loss_log, "a") as f:
                f.write(f"{it} {float(loss)!r}\n")
        if self.strategy is not None:
            with named_collective(f"a collective of the auto strategy (calibration or plan) at iteration {it}"):
                self.strategy.step(it)  # compression/dense_comm=auto: calibrate, plan (a collective), re-plan

    def close(self) -> None:
        self.bar.close()
