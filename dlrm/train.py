"""Hydra entry point: `torchrun --nproc_per_node N -m dlrm.train [overrides]` (also `dlrm-train`).

Reads top to bottom: process group, data, model, sharding (with the compressed all-to-all),
optimizers, resume, the training loop with evaluation and checkpoints, the final test pass.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from compression.policies import TableStats, build_policy
from dlrm import checkpoint
from dlrm.comm import (comm_stats_all_ranks, comm_summary, make_sharders, parse_compression_cfg, qcomm_ratios,
                       set_iteration)
from dlrm.datasets import criteo_batches, dataset_info, prepare_data, split_stems
from dlrm.env import DistEnv, init_distributed, shutdown
from dlrm.loop import Stepper, evaluate, take
from dlrm.metrics import write_metrics_json
from dlrm.model import build_model
from dlrm.optim import WarmupDecayLR, apply_sparse_optimizer, build_optimizer
from dlrm.run_dir import register_resolvers
from dlrm.sharding import describe_plan, shard_model
from dlrm.tb_layout import policy_scalars
from dlrm.tb_logger import TensorBoardLogger

log = logging.getLogger("dlrm.train")
CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")
register_resolvers()
# Deprecation chatter from TorchRec/FBGEMM internals on every run; our own warnings still show.
for _module in ("torchrec", "fbgemm_gpu", "torch.distributed", "torchmetrics"):
    warnings.filterwarnings("ignore", module=_module)


def run(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    env = init_distributed(cfg.device)
    torch.manual_seed(cfg.seed)
    data_dir = prepare_data(cfg.data, env)
    info = dataset_info(data_dir)
    splits = split_stems(cfg.data, info, data_dir)

    def batches(split: str, batch_size: int, epoch: int = 0, start: int = 0, shuffle: bool = False):
        return criteo_batches(data_dir, splits[split], batch_size, env.rank, env.world_size,
                              shuffle=shuffle, seed=cfg.seed, epoch=epoch, start_batch=start)

    model = build_model(cfg.model, info["sparse_features"], info["num_embeddings"], len(info["dense_features"]))
    apply_sparse_optimizer(model, cfg.optimizer)
    features = list(info["sparse_features"])
    table_names = [f"t_{name}" for name in features]
    spec = parse_compression_cfg(cfg.compression)
    policy = None
    if spec.kind == "compressed":  # QComms has no bounds; every other codec asks the policy
        policy = build_policy(cfg.policy, [TableStats(f, n, cfg.model.embedding_dim)
                                           for f, n in zip(features, info["num_embeddings"])],
                              modes={"forward": spec.forward.mode, "backward": spec.backward.mode})
    sharders = make_sharders(cfg.compression, bound_fn_forward=policy, bound_fn_backward=policy)
    model = shard_model(model, cfg.sharding, env, sharders, cfg.batch_size, table_names, cfg.model.embedding_dim)
    optimizer = build_optimizer(model, cfg.optimizer)
    schedule = WarmupDecayLR(optimizer, **cfg.lr_schedule)

    tb = TensorBoardLogger(run_dir / "tensorboard" if env.is_main else None)
    plan = describe_plan(model)
    if env.is_main:
        log.info("sharding plan: %s", plan)
        tb.text("config", f"```\n{OmegaConf.to_yaml(cfg)}\n```")

    iteration, epoch, batch_in_epoch = 0, 0, 0
    ckpt_root = Path(cfg.checkpoint.dir)
    if cfg.resume not in ("auto", True, False):
        raise ValueError(f"config key 'resume' must be auto, true or false (got {cfg.resume!r})")
    last = checkpoint.latest_step(ckpt_root) if cfg.resume else None
    if cfg.resume is True and last is None:
        raise FileNotFoundError(f"resume=true but {ckpt_root} holds no complete checkpoint")
    if last is not None:
        state = checkpoint.load(last, model, optimizer, env.rank, env.world_size)
        iteration, epoch, batch_in_epoch = state["iteration"], state["epoch"], state["batch_in_epoch"]
        schedule.load_state_dict(state["lr_schedule"])
        set_iteration(model, iteration)
        if policy is not None:
            policy.load_state_dict(state.get("policy", {}))
        if env.is_main:
            log.info("resumed from %s at iteration %d (epoch %d, batch %d)", last, iteration, epoch, batch_in_epoch)

    def save() -> None:
        checkpoint.save(ckpt_root, model, optimizer, {
            "iteration": iteration, "epoch": epoch, "batch_in_epoch": batch_in_epoch,
            "world_size": env.world_size, "lr_schedule": schedule.state_dict(),
            "policy": policy.state_dict() if policy is not None else {},
        }, env.rank, keep=cfg.checkpoint.keep)

    stepper = Stepper(model, optimizer, env.device, pipelined=cfg.pipeline)
    steps_per_epoch = len(batches("train", cfg.batch_size))
    total = steps_per_epoch * cfg.epochs if cfg.max_iterations is None else min(cfg.max_iterations, steps_per_epoch * cfg.epochs)
    bar = tqdm(total=total, initial=iteration, desc="train", disable=not (env.is_main and cfg.progress_bar))
    train_seconds, samples_seen, last_val = 0.0, 0, {}
    window_start, window_samples = time.perf_counter(), 0

    def on_step(loss: torch.Tensor) -> None:
        nonlocal iteration, batch_in_epoch, window_start, window_samples
        iteration += 1
        batch_in_epoch += 1
        schedule.step()
        window_samples += cfg.batch_size * env.world_size
        bar.update(1)
        if iteration % cfg.log_every == 0:
            now = time.perf_counter()
            tb.scalars({"train/loss": float(loss), "train/lr": schedule.lr,
                        "train/samples_per_s": window_samples / max(now - window_start, 1e-9)}, iteration)
            comm = comm_stats_all_ranks(model)  # a collective: every rank logs
            tb.scalars(comm, iteration)
            if policy is not None:
                policy.observe(iteration, comm)  # the same merged stats on every rank: same bounds
                tb.scalars(policy_scalars(policy, iteration, features), iteration)
            window_start, window_samples = now, 0
        if env.is_main and cfg.loss_log:
            with open(run_dir / "losses.txt", "a") as f:
                f.write(f"{iteration} {float(loss)!r}\n")

    def boundary(i: int) -> int:
        """The next iteration after ``i`` at which the pipeline must be drained."""
        stops = [total, (epoch + 1) * steps_per_epoch]
        for every in (cfg.eval_every, cfg.checkpoint.every):
            if every:
                stops.append((i // every + 1) * every)
        return min(s for s in stops if s > i)

    while iteration < total:
        if batch_in_epoch >= steps_per_epoch:
            epoch, batch_in_epoch = epoch + 1, 0
        stop = boundary(iteration)
        train_iter = iter(batches("train", cfg.batch_size, epoch, batch_in_epoch, cfg.data.shuffle))
        before, t0 = iteration, time.perf_counter()
        stepper.run(take(train_iter, stop - iteration), on_step)
        train_seconds += time.perf_counter() - t0
        samples_seen += (iteration - before) * cfg.batch_size * env.world_size
        stepper.release()
        at_epoch_end = batch_in_epoch >= steps_per_epoch
        if (cfg.eval_every and iteration % cfg.eval_every == 0) or (not cfg.eval_every and at_epoch_end):
            last_val = evaluate(model, take(iter(batches("val", cfg.eval_batch_size)), cfg.limit_eval_batches), env.device)
            tb.scalars({f"eval/{k}": v for k, v in last_val.items() if k != "samples"}, iteration)
            if env.is_main:
                log.info("iteration %d: val %s", iteration, last_val)
        if cfg.checkpoint.every and iteration % cfg.checkpoint.every == 0 and iteration < total:
            save()
    bar.close()
    save()

    test = evaluate(model, iter(batches("test", cfg.eval_batch_size)), env.device)
    comm = comm_summary(model)
    if spec.kind == "qcomm":  # TorchRec's own path counts no bytes; its fixed rate gives the ratio
        comm.update(qcomm_ratios(spec))
    metrics = {
        **test,
        "val_auc": last_val.get("auc"), "val_logloss": last_val.get("logloss"),
        "iterations": iteration,
        "samples_per_s": samples_seen / train_seconds if train_seconds else None,
        **comm,
        "config_name": cfg.run_name, "world_size": env.world_size,
        "compression": cfg.compression.name, "sharding_plan": plan,
        **(policy.summary() if policy is not None else {"policy": None}),
    }
    tb.scalars({f"test/{k}": test[k] for k in ("auc", "logloss", "accuracy")}, iteration)
    tb.hparams(flat_config(cfg), {"hparam/auc": test["auc"], "hparam/logloss": test["logloss"],
                                  "hparam/forward_ratio": comm["forward_ratio"],
                                  "hparam/backward_ratio": comm["backward_ratio"]})
    tb.close()
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


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    run_dir = Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)
    metrics = run(cfg, run_dir)
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"\ntest AUC {metrics['auc']:.4f}  logloss {metrics['logloss']:.4f}  "
              f"accuracy {metrics['accuracy']:.4f}  (val AUC {metrics['val_auc'] or float('nan'):.4f})")
        print(f"forward ratio {metrics['forward_ratio']:.2f}x  backward ratio {metrics['backward_ratio']:.2f}x  "
              f"max abs error {metrics['max_abs_error_seen']:.3g}  {metrics['samples_per_s'] or 0:.0f} samples/s")
        print(f"run directory: {run_dir}")
        print(f"TensorBoard:   tensorboard --logdir {run_dir / 'tensorboard'}")


if __name__ == "__main__":
    main()
