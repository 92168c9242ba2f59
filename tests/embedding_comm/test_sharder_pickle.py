"""Our sharder crosses process boundaries as TorchRec's do: pickled, handed to ranks that TorchRec's
own multi-process harness starts, it shards and trains like stock TorchRec."""

from __future__ import annotations

import pickle

import torch
from test_comm import (
    CONFIGS,
    LOSSY,
    NONE,
    batch,
    build,
    full_weights,
    local_weights,
    ours,
    reference_out,
    run_steps,
    shipped,
    stock_sharder,
)
from torchrec.distributed.test_utils.multi_process import MultiProcessContext, MultiProcessTestBase


def test_every_shipped_compressed_sharder_pickles_and_encodes_after_a_round_trip():
    from hydra import compose, initialize_config_dir

    from dlrm.embedding_comm import make_sharders, parse_compression_cfg
    from dlrm.embedding_comm.policy import policy_for_run, table_stats

    criteo = [f"cat_{i}" for i in range(26)]  # the trainer's features, as the table-wise classes know them
    tables = table_stats(criteo, [1000 * (i + 1) for i in range(26)], 8)
    sharders = [ours(LOSSY), ours(shipped("dct_mp"))]
    with initialize_config_dir(config_dir=str(CONFIGS.parent), version_base="1.3"):
        for path in sorted((CONFIGS.parent / "policy").glob("*.yaml")):  # the trainer's bound policies
            cfg = compose("config", overrides=[f"policy={path.stem}", "compression=lossy"])
            policy = policy_for_run(cfg.policy, parse_compression_cfg(cfg.compression), tables)
            sharders += make_sharders(cfg.compression, bound_fn_forward=policy, bound_fn_backward=policy)
    chunk = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    for sharder in sharders:
        copy = pickle.loads(pickle.dumps(sharder))
        for d in ("forward", "backward"):
            a, b = sharder.runtime.codecs[d], copy.runtime.codecs[d]
            bounds = a.bounds(chunk, [8], a.policy(["cat_3"], 3))
            assert torch.equal(a.encode(chunk, [8], bounds, None), b.encode(chunk, [8], bounds, None)), d


def _none_matches_stock(rank: int, world_size: int, sharder, lossy) -> None:
    """On a rank of TorchRec's harness: the sharder it handed us (pickled) trains as stock TorchRec."""
    with MultiProcessContext(rank, world_size, backend="gloo"):
        torch.set_num_threads(1)
        w = full_weights()
        ref = run_steps(build(stock_sharder(), "mixed", world_size, w), rank, [16] * world_size, 2)
        mine = build(sharder, "mixed", world_size, w)
        got = run_steps(mine, rank, [16] * world_size, 2)
        for a, b in zip(ref, got, strict=True):
            assert torch.equal(a, b), f"rank {rank}: forward differs by {(a - b).abs().max()}"
        stock = build(stock_sharder(), "mixed", world_size, w)
        run_steps(stock, rank, [16] * world_size, 2)
        wa, wb = local_weights(stock), local_weights(mine)
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), f"rank {rank}: weights"
        # a lossy sharder's codecs (zstd contexts included) work in the rank they were handed to
        lossy_out = run_steps(build(lossy, "mixed", world_size, w), rank, [16] * world_size, 1)[0]
        err = float((lossy_out - reference_out(w, batch(rank, 0, 16))).abs().max())
        assert 0 < err <= 1e-3 * (1 + 1e-5) + 1e-7, f"rank {rank}: lossy error {err}"


class TorchRecHarnessTest(MultiProcessTestBase):
    def test_torchrec_harness_hands_our_sharder_to_its_ranks(self) -> None:
        self._run_multi_process_test(callable=_none_matches_stock, world_size=2, sharder=ours(NONE), lossy=ours(LOSSY))
