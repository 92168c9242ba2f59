"""Hydra entry point: `torchrun --nproc_per_node N -m dlrm.train [overrides]` (also `dlrm-train`).

:func:`run` reads top to bottom: process group, data, model, then one component per feature
(:mod:`dlrm.trainer.component`: embedding compression, precision, dense comm, placement, strategy,
telemetry) whose additions shard the model, whose checkpoint parts the checkpointer saves, whose
observers watch the loop and whose metrics end in metrics.json; then resume, the training loop with
evaluation and checkpoints, the final test pass.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import hydra
import hydra.core.hydra_config
import torch
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from torch.distributed.checkpoint.stateful import Stateful

from dlrm.dense_comm.component import DenseCommunication
from dlrm.embedding_comm.component import EmbeddingCompression
from dlrm.embedding_comm.policy import table_stats
from dlrm.placement.component import Placement
from dlrm.precision.component import Precision
from dlrm.process.config_checks import check_moved_keys
from dlrm.process.env import exit_without_teardown, init_distributed, shutdown
from dlrm.process.launch import check_launch_keys, launch_ranks, module_of, objectives, rank_source, submitit_rendezvous
from dlrm.process.run_dir import register_resolvers
from dlrm.strategy.component import Strategy
from dlrm.telemetry.comm_stats import comm_summary, set_iteration
from dlrm.telemetry.component import Telemetry
from dlrm.telemetry.metrics import final_metrics, write_metrics_json
from dlrm.trainer.checkpoint import Checkpointer
from dlrm.trainer.component import Component, Sharding, checkpoint_parts
from dlrm.trainer.datasets import RunData
from dlrm.trainer.early_stopping import EarlyStopping
from dlrm.trainer.loop import LoopPlan, StepObserver, Stepper, TrainState, train
from dlrm.trainer.model import build_model, table_names
from dlrm.trainer.optim import WarmupDecayLR, apply_sparse_optimizer, build_optimizer
from dlrm.trainer.sharding import shard_model
from dlrm.trainer.validation import Validation

log = logging.getLogger("dlrm.train")
CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")
register_resolvers()


def run(cfg: DictConfig, run_dir: Path, observers: Sequence[StepObserver] = ()) -> dict[str, Any]:
    env = init_distributed(cfg.device, cfg.comm_timeout_s)
    torch.manual_seed(cfg.seed)
    data = RunData.from_config(cfg.data, env, cfg.seed)
    dim = int(cfg.model.embedding_dim)
    precision = Precision(cfg.precision)
    tables = table_stats(data.features, data.num_embeddings, dim)
    compression = EmbeddingCompression(cfg.compression, cfg.policy, cfg.sharding, tables, precision.spec.fused_params)
    model = build_model(cfg.model, data.features, data.num_embeddings, data.num_dense, **precision.model_options(env))
    apply_sparse_optimizer(model, cfg.optimizer)
    dense = DenseCommunication(cfg.dense_comm)
    placement = Placement(cfg, env, data, compression, dense)
    components: list[Component] = [compression, precision, dense, placement]
    sharding = Sharding()
    for c in components:  # in order: the sharders and runtime first, the planner that prices them last
        c.shard(sharding)
    names = table_names(data.features)
    model = shard_model(model, cfg.sharding, env, sharding.sharders, cfg.batch_size, names, dim, **sharding.options)
    placement.replicate(model)
    optimizer = build_optimizer(model, cfg.optimizer, placement.optimizers)
    schedule = WarmupDecayLR(optimizer, **cfg.lr_schedule)
    telemetry = Telemetry(cfg, env, run_dir, model, data, compression, dense, placement)
    strategy = Strategy(env, compression, dense, run_dir, telemetry.text)
    components += [strategy, telemetry]
    stopping = EarlyStopping.from_config(cfg.early_stopping)
    own: dict[str, Stateful] = {"lr_schedule": schedule, **({"early_stopping": stopping} if stopping else {})}
    parts = checkpoint_parts(components, **own)
    ckpt = Checkpointer(Path(cfg.checkpoint.dir), env, model, optimizer, parts, keep=cfg.checkpoint.keep)
    best = Checkpointer(Path(cfg.checkpoint.dir) / "best", env, model, optimizer, parts, keep=1)
    state = ckpt.resume(cfg.resume)
    set_iteration(model, state.iteration)  # the policies' iteration continues where it was
    strategy.controller.start(state.iteration)  # auto: time the link, begin calibrating (or replay a strategy)
    steps_per_epoch = len(data.batches("train", cfg.batch_size))
    total = min(cfg.max_iterations or sys.maxsize, steps_per_epoch * cfg.epochs)
    loop = LoopPlan(total, steps_per_epoch, eval_every=cfg.eval_every, checkpoint_every=cfg.checkpoint.every)
    global_batch = cfg.batch_size * env.world_size
    progress = telemetry.start(model, schedule, strategy.active, global_batch, loop.total, state.iteration)

    def batches(split: str, batch_size: int, *position: Any) -> Any:  # hot ids split off when replicated
        return placement.split(data.batches(split, batch_size, *position))

    val_batches = lambda: batches("val", cfg.eval_batch_size)  # noqa: E731
    validation = Validation(model, env, val_batches, cfg.limit_eval_batches, stopping, best, validated(components))

    def on_drained(s: TrainState) -> None:
        if loop.eval_due(s):
            validation.run(s)
        if loop.checkpoint_due(s):
            ckpt.save(s)

    stepper = Stepper(model, optimizer, env.device, pipelined=cfg.pipeline)
    train_batches = lambda epoch, start: batches("train", cfg.batch_size, epoch, start, cfg.data.shuffle)  # noqa: E731
    watchers = [*(o for c in components for o in c.observers), *observers]
    stopped = lambda: validation.stopped  # noqa: E731
    train(state, loop, stepper, train_batches, global_batch, schedule, progress.step, on_drained, watchers, stopped)
    for c in reversed(components):
        c.close()
    ckpt.save(state)
    test = batches("test", cfg.eval_batch_size)
    metrics = run_metrics(cfg, env, model, state, components, validation, test, compression, dense)
    telemetry.tb.final(metrics, state.iteration, flat_config(cfg))
    if env.is_main:
        write_metrics_json(run_dir / "metrics.json", metrics)
    shutdown()
    return metrics


def validated(components: Sequence[Component]) -> Callable[[Mapping[str, float | None], int], None]:
    """A validation pass's metrics to every component (TensorBoard, the policy's plateau)."""

    def report(values: Mapping[str, float | None], iteration: int) -> None:
        for c in components:
            c.validated(values, iteration)

    return report


def run_metrics(
    cfg: DictConfig,
    env: Any,
    model: torch.nn.Module,
    state: TrainState,
    components: Sequence[Component],
    validation: Validation,
    test_batches: Any,
    compression: EmbeddingCompression,
    dense: DenseCommunication,
) -> dict[str, Any]:
    """metrics.json's content: the test pass (on the best validation step's weights with early
    stopping), the last validation pass, the run's figures and every component's metrics."""
    extra = {k: v for c in components for k, v in c.metrics(model, state).items()}
    test, stopping = validation.test(test_batches)
    extra.update(stopping)
    return final_metrics(
        test,
        validation.last,
        iterations=state.iteration,
        samples_per_s=state.samples_per_s,
        comm=comm_summary(model, compression.spec, dense.dense),
        policy=compression.policy.summary() if compression.policy else {"policy": None},
        config_name=cfg.run_name,
        world_size=env.world_size,
        compression=cfg.compression.name,
        **extra,
    )


def flat_config(cfg: DictConfig) -> dict[str, Any]:
    """Dotted keys of the resolved config's scalar leaves (the TensorBoard hparams)."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        elif not isinstance(node, list):
            out[prefix[:-1]] = node

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return {k: v for k, v in out.items() if not k.startswith("checkpoint.dir")}


def print_summary(metrics: dict[str, Any], run_dir: Path) -> None:
    def auc(v: float | None) -> str:  # None: undefined (one class; warned) or no validation ran
        return "n/a" if v is None else f"{v:.4f}"

    print(
        f"\ntest AUC {auc(metrics['auc'])}  logloss {metrics['logloss']:.4f}  "
        f"accuracy {metrics['accuracy']:.4f}  (val AUC {auc(metrics['val_auc'])})"
    )
    print(
        f"forward ratio {metrics['forward_ratio']:.2f}x  backward ratio {metrics['backward_ratio']:.2f}x  "
        f"max abs error {metrics['max_abs_error_seen']:.3g}  {metrics['samples_per_s'] or 0:.0f} samples/s"
    )
    print(f"run directory: {run_dir}")
    print(f"TensorBoard:   tensorboard --logdir {run_dir / 'tensorboard'}")


def hydra_main(run_fn: Any = run) -> Any:
    """The Hydra entry point of ``run_fn(cfg, run_dir)`` over ``configs/`` (the probe reuses it).

    A sweep job (`-m`) outside torchrun launches its own ranks (dlrm.process.launch); the job returns the
    config's ``objectives`` for an optimising sweeper.
    """

    @hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
    def entry(cfg: DictConfig) -> list[float]:
        hc = hydra.core.hydra_config.HydraConfig.get()
        run_dir = Path(hc.runtime.output_dir)
        multirun = hc.mode == RunMode.MULTIRUN
        source = rank_source(multirun)
        check_launch_keys(source, multirun, list(hc.overrides.task), cfg.launch)
        if source == "launch":
            metrics = launch_ranks(
                module_of(run_fn),
                list(hc.overrides.task),
                run_dir,
                nproc_per_node=cfg.launch.nproc_per_node,
                max_restarts=cfg.launch.max_restarts,
            )
        else:
            if source == "submitit":
                os.environ.update(submitit_rendezvous(cfg.launch.master_port))
            metrics = run_fn(cfg, run_dir)
            if int(os.environ.get("RANK", 0)) == 0:
                print_summary(metrics, run_dir)
        return objectives(metrics, list(cfg.objectives))

    return entry


def main() -> None:
    check_moved_keys(sys.argv[1:])
    hydra_main(run)()
    exit_without_teardown()


if __name__ == "__main__":
    main()
