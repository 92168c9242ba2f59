"""Benchmark the compressed embedding all-to-alls against stock TorchRec on local gloo ranks.

    python -m dlrm.bench.comm --ranks 2 --batch 1024 --configs none,fp16,lossy,qcomm_fp16

Per config (``configs/compression/<name>.yaml``, plus ``stock`` = TorchRec without QComms) it
trains a DLRM-shaped EBC (single-valued skewed ids, fused SGD) for a few iterations and prints
ms per iteration and the statistics of :func:`dlrm.embedding_comm.comm_stats_all_ranks`. CPU/gloo timings
on a shared machine only compare configs with each other; they say nothing about GPUs.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "compression"


def _model(args: argparse.Namespace, sharder: Any, ws: int):
    from torch import nn
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(
                tables=[
                    EmbeddingBagConfig(
                        name=f"t{i}", embedding_dim=args.dim, num_embeddings=args.rows, feature_names=[f"f{i}"]
                    )
                    for i in range(args.tables)
                ],
                device=torch.device("meta"),
            )
            self.scale = nn.Parameter(torch.ones(1))

        def forward(self, kjt):
            return self.ebc(kjt).values() * self.scale

    net = Net()
    apply_optimizer_in_backward(torch.optim.SGD, net.ebc.parameters(), {"lr": 0.01})
    gen = {"table_wise": lambda i: table_wise(rank=i % ws), "row_wise": lambda i: row_wise()}[args.sharding]
    plan = construct_module_sharding_plan(
        net.ebc,
        {f"t{i}": gen(i) for i in range(args.tables)},
        sharder=sharder,
        local_size=ws,
        world_size=ws,
        device_type="cpu",
    )
    return DistributedModelParallel(
        net, device=torch.device("cpu"), plan=ShardingPlan({"ebc": plan}), sharders=[sharder]
    )


def _batch(args: argparse.Namespace, rank: int, step: int):
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(step * 1009 + rank)
    values = (torch.rand(args.tables * args.batch, generator=g) ** args.skew * args.rows).long()
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(args.tables)],
        values=values,
        lengths=torch.ones(args.tables * args.batch, dtype=torch.int32),
    )


def _sharder(name: str, eb: float):
    from hydra import compose, initialize_config_dir

    from dlrm.embedding_comm import fixed_bound, make_sharders, parse_compression_cfg
    from dlrm.embedding_comm.embeddingbag import StockEmbeddingBagCollectionSharder

    if name == "stock":
        return StockEmbeddingBagCollectionSharder()
    with initialize_config_dir(config_dir=str(CONFIGS.parent), version_base="1.3"):  # as the trainer composes it
        cfg = compose("config", overrides=[f"compression={name}"]).compression
    bound = fixed_bound(eb) if parse_compression_cfg(cfg).kind == "compressed" else None
    return make_sharders(cfg, bound_fn_forward=bound, bound_fn_backward=bound)[0]


def _rank(rank: int, ws: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(ws))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=ws)
    from dlrm.telemetry.comm_stats import comm_stats_all_ranks

    try:
        for name in args.configs.split(","):
            model = _model(args, _sharder(name, args.eb), ws)
            grads = torch.randn(args.batch, args.tables * args.dim, generator=torch.Generator().manual_seed(rank))
            batches = [_batch(args, rank, s) for s in range(args.warmup + args.iters)]
            for s, kjt in enumerate(batches):
                if s == args.warmup:
                    comm_stats_all_ranks(model)  # drop the warm-up window
                    dist.barrier()
                    t0 = time.perf_counter()
                (model(kjt) * grads).sum().backward()
            dist.barrier()
            ms = 1e3 * (time.perf_counter() - t0) / args.iters
            stats = comm_stats_all_ranks(model)
            if rank == 0:
                queue.put((name, ms, stats))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--batch", type=int, default=1024, help="samples per rank")
    p.add_argument("--tables", type=int, default=26)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--skew", type=float, default=3.0, help="ids = rows * U^skew (larger: more duplicates)")
    p.add_argument("--sharding", choices=["table_wise", "row_wise"], default="table_wise")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--configs", default="stock,none,fp16,int8,lossy,qcomm_fp16")
    p.add_argument(
        "--eb",
        type=float,
        default=0.01,
        help="every table's bound, in each config's mode (lossy: 0.01 of each block's range)",
    )
    args = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, args, queue)) for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    if any(proc.exitcode for proc in procs):
        raise SystemExit(f"a rank failed (exit codes {[proc.exitcode for proc in procs]})")
    print(
        f"{args.ranks} ranks, batch {args.batch}/rank, {args.tables} tables x dim {args.dim}, {args.sharding}, "
        f"{args.iters} iterations (CPU/gloo: relative figures only)"
    )
    print(
        f"{'config':12} {'ms/iter':>8} {'fwd ratio':>9} {'bwd ratio':>9} {'codec ms/it':>11} {'comm ms/it':>10} "
        f"{'max err fwd':>11} {'err/bound':>9}"
    )
    while not queue.empty():
        name, ms, s = queue.get()
        it = args.iters
        print(
            f"{name:12} {ms:8.1f} {s.get('comm/forward/ratio', float('nan')):9.2f} "
            f"{s.get('comm/backward/ratio', float('nan')):9.2f} "
            f"{(s.get('comm/forward/codec_ms', 0) + s.get('comm/backward/codec_ms', 0)) / it / args.ranks:11.1f} "
            f"{(s.get('comm/forward/comm_ms', 0) + s.get('comm/backward/comm_ms', 0)) / it / args.ranks:10.1f} "
            f"{s.get('comm/forward/max_abs_error', float('nan')):11.2e} "
            f"{s.get('comm/forward/max_error_over_bound', float('nan')):9.3f}"
        )


if __name__ == "__main__":
    main()
