"""Hydra entry point: `torchrun --nproc_per_node N -m dlrm.train [overrides]` (also `dlrm-train`).

:func:`run` reads top to bottom: process group, data, model, sharding (with the compressed
all-to-all and its bound policy), optimizers, resume, the training loop with evaluation and
checkpoints, the final test pass and metrics.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hydra
import hydra.core.hydra_config
import torch
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from dlrm.dense_comm.config import parse_dense_comm_cfg
from dlrm.dense_comm.hook import CompressedDataParallelWrapper, DenseComm
from dlrm.embedding_comm import compression_runtime, make_sharders, parse_compression_cfg
from dlrm.embedding_comm.config import CompressionSpec, excluded_sharding_types
from dlrm.embedding_comm.policy import bounded_directions, policy_for_run, table_stats
from dlrm.placement.comm_aware import build_planner, log_plan
from dlrm.placement.config import PlacementSpec, parse_placement_cfg
from dlrm.placement.replication import setup_replication
from dlrm.precision.config import embedding_bytes_per_rank, parse_precision_cfg
from dlrm.process.config_checks import check_moved_keys
from dlrm.process.env import exit_without_teardown, init_distributed, shutdown
from dlrm.process.launch import check_launch_keys, launch_ranks, module_of, objectives, rank_source, submitit_rendezvous
from dlrm.process.run_dir import register_resolvers
from dlrm.strategy.controller import StrategyController, parse_strategy_cfg
from dlrm.telemetry.comm_stats import comm_summary, set_iteration
from dlrm.telemetry.metrics import final_metrics, write_metrics_json
from dlrm.telemetry.progress import Progress
from dlrm.telemetry.tb_logger import TensorBoardLogger
from dlrm.telemetry.wire import WireMeter, placements, wire_metrics
from dlrm.trainer.checkpoint import Checkpointer
from dlrm.trainer.datasets import RunData
from dlrm.trainer.loop import LoopPlan, StepObserver, Stepper, TrainState, evaluate, take, train
from dlrm.trainer.model import build_model, table_names
from dlrm.trainer.optim import WarmupDecayLR, apply_sparse_optimizer, build_optimizer
from dlrm.trainer.sharding import check_supported, describe_plan, shard_model

log = logging.getLogger("dlrm.train")
CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")
register_resolvers()


def refuse_host_only(device: torch.device, spec: CompressionSpec, placement: PlacementSpec) -> None:
    """Hot-row replication, the forward row cache and its probe keep their state on the host (numpy
    arrays, CPU buffers, gloo-sized collectives): refuse them on an accelerator, naming the keys."""
    cache = spec.forward is not None and spec.forward.cache_rows is not None
    used = {
        "placement.hot_rows": placement.replicates,
        "compression.forward.cache.enabled": cache,
        "compression.stats.cache_probe.enabled": spec.cache_probe_rows is not None,
    }
    on = [key for key, is_on in used.items() if is_on]
    if device.type != "cpu" and on:
        raise ValueError(f"{', '.join(on)}: CPU runs only so far (this run is on {device}); turn it off")


def run(cfg: DictConfig, run_dir: Path, observers: Sequence[StepObserver] = ()) -> dict[str, Any]:
    env = init_distributed(cfg.device, cfg.comm_timeout_s)
    torch.manual_seed(cfg.seed)
    data = RunData.from_config(cfg.data, env, cfg.seed)
    dim = int(cfg.model.embedding_dim)
    spec = parse_compression_cfg(cfg.compression)
    policy = policy_for_run(cfg.policy, spec, table_stats(data.features, data.num_embeddings, dim))
    precision = parse_precision_cfg(cfg.precision)
    model = build_model(
        cfg.model,
        data.features,
        data.num_embeddings,
        data.num_dense,
        data_type=precision.data_type,
        dense_dtype=precision.dense_dtype,
        device_type=env.device.type,
    )
    apply_sparse_optimizer(model, cfg.optimizer)
    sharders = make_sharders(
        cfg.compression, bound_fn_forward=policy, bound_fn_backward=policy, fused_params=precision.fused_params
    )
    dense = DenseComm(parse_dense_comm_cfg(cfg.dense_comm))  # the hook on DMP's DDP of the MLPs
    placement = parse_placement_cfg(cfg.placement, cfg.sharding.type, len(data.features))
    refuse_host_only(env.device, spec, placement)
    # id statistics, for the traffic model and hot-row replication
    freqs, _ = data.frequency(cfg.batch_size, placement.estimate_batches, placement.top_n)
    runtime = compression_runtime(sharders)  # None on TorchRec's QComms path
    planner, traffic = None, None
    if cfg.sharding.type == "comm_aware":
        planner, traffic = build_planner(
            env,
            cfg.sharding,
            placement,
            spec,
            runtime,
            dense.spec.hooked,
            data.features,
            freqs,
            cfg.batch_size,
            dim,
            cfg.seed,
            fused_only=precision.fused_only,
        )
    check_supported(cfg.sharding, spec.sharding_types, excluded_sharding_types(spec))
    model = shard_model(
        model,
        cfg.sharding,
        env,
        sharders,
        cfg.batch_size,
        table_names(data.features),
        dim,
        data_parallel_wrapper=CompressedDataParallelWrapper(dense),
        fused_only=precision.fused_only,
        planner=planner,
    )
    tables = placements(model, dict(zip(table_names(data.features), data.num_embeddings, strict=True)), dim)
    table_freqs = dict(zip(table_names(data.features), freqs, strict=True))
    if traffic is not None and env.is_main:
        log_plan(tables, traffic, table_freqs)
    replication = setup_replication(
        placement,
        model,
        data.features,
        freqs,
        cfg.optimizer,
        spec,
        cfg.batch_size,
        dim,
        backward_codec=runtime.backward if runtime is not None else None,
    )
    meter = WireMeter(
        sum(t.num_embeddings * t.dim for t in tables if t.kind == "data_parallel"),
        env.world_size,
        (lambda: replication.optimizer.sent_bytes) if replication else None,
    )
    optimizer = build_optimizer(model, cfg.optimizer, [replication.optimizer] if replication else [])

    def batches(split: str, batch_size: int, *position: Any) -> Any:  # hot ids split off when replicated
        out = data.batches(split, batch_size, *position)
        return replication.split.batches(out) if replication else out

    schedule = WarmupDecayLR(optimizer, **cfg.lr_schedule)
    tb = TensorBoardLogger(run_dir / "tensorboard" if env.is_main else None)
    plan = describe_plan(model)
    if env.is_main:
        log.info("sharding plan: %s", plan)
        tb.text("config", f"```\n{OmegaConf.to_yaml(cfg)}\n```")

    strategy = StrategyController(
        parse_strategy_cfg(spec.strategy, spec.strategy_file),
        env,
        runtime if spec.auto else None,
        dense if dense.spec.name == "auto" else None,
        run_dir,
        tb.text if env.is_main else None,
    )
    parts = {
        "lr_schedule": schedule,
        "policy": policy,
        "strategy": strategy if strategy.active else None,
        "dense_comm": dense,
        "compression": runtime,
        "hot_rows": replication,
    }
    ckpt = Checkpointer(
        Path(cfg.checkpoint.dir),
        env,
        model,
        optimizer,
        {name: part for name, part in parts.items() if part is not None},
        keep=cfg.checkpoint.keep,
    )
    state = ckpt.resume(cfg.resume)
    set_iteration(model, state.iteration)  # the policies' iteration continues where it was
    strategy.start(state.iteration)  # auto: time the link, begin calibrating (or replay a strategy)
    steps_per_epoch = len(data.batches("train", cfg.batch_size))
    loop = LoopPlan(
        total=min(cfg.max_iterations or sys.maxsize, steps_per_epoch * cfg.epochs),
        steps_per_epoch=steps_per_epoch,
        eval_every=cfg.eval_every,
        checkpoint_every=cfg.checkpoint.every,
    )
    global_batch = cfg.batch_size * env.world_size
    progress = Progress(
        env,
        model,
        schedule,
        tb,
        policy,
        data.features,
        bounded=bounded_directions(spec),
        dense=dense,
        strategy=strategy if strategy.active else None,
        global_batch=global_batch,
        log_every=cfg.log_every,
        total=loop.total,
        start=state.iteration,
        progress_bar=cfg.progress_bar,
        loss_log=run_dir / "losses.txt" if cfg.loss_log else None,
    )
    last_val: dict[str, Any] = {}

    def on_drained(s: TrainState) -> None:
        if loop.eval_due(s):
            val = batches("val", cfg.eval_batch_size)
            last_val.update(evaluate(model, take(iter(val), cfg.limit_eval_batches), env.device, "val"))
            tb.scalars({f"eval/{k}": v for k, v in last_val.items() if k != "samples"}, s.iteration)
            if env.is_main:
                log.info("iteration %d: val %s", s.iteration, last_val)
        if loop.checkpoint_due(s):
            ckpt.save(s)

    train(
        state,
        loop,
        Stepper(model, optimizer, env.device, pipelined=cfg.pipeline),
        lambda epoch, start: batches("train", cfg.batch_size, epoch, start, cfg.data.shuffle),
        global_batch,
        schedule,
        progress.step,
        on_drained,
        [meter, *observers],
    )
    progress.close()
    strategy.close()
    ckpt.save(state)

    hot_metrics = replication.metrics(meter.iterations) if replication else {}
    wire = wire_metrics(
        model,
        meter,
        spec,
        tables,
        table_freqs,
        env.world_size,
        state.rank_samples / max(meter.iterations, 1),  # the batch trained: a short last one included
        data.features,
        hot=replication.summary["tables"] if replication else None,
        sync=replication.sync_traffic(hot_metrics["hot_rows"]["sync_row_ratio"]) if replication else None,
    )
    if env.is_main and wire["wire_bytes_per_iteration"] is not None:
        log.info(
            "wire bytes per iteration (embedding path, all ranks): measured %.0f, predicted %.0f",
            wire["wire_bytes_per_iteration"],
            wire["predicted_wire_bytes_per_iteration"],
        )
    test = evaluate(model, batches("test", cfg.eval_batch_size), env.device, "test")
    metrics = final_metrics(
        test,
        last_val,
        iterations=state.iteration,
        samples_per_s=state.samples_per_s,
        comm=comm_summary(model, spec, dense),
        policy=policy.summary() if policy else {"policy": None},
        config_name=cfg.run_name,
        world_size=env.world_size,
        compression=cfg.compression.name,
        sharding_plan=plan,
        precision={"embeddings": precision.embeddings, "dense": precision.dense},
        embedding_bytes_per_rank=embedding_bytes_per_rank(model),
        **wire,
        **strategy.metrics(),
        **hot_metrics,
    )
    tb.final(metrics, state.iteration, flat_config(cfg))
    if env.is_main:
        write_metrics_json(run_dir / "metrics.json", metrics)
    shutdown()
    return metrics


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
