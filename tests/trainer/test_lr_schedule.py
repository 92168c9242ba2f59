"""DLRM's learning-rate schedule (dlrm.trainer.optim.WarmupDecayLR) against values worked out by hand.

The schedule as DLRM defines it (facebookresearch/dlrm ``LRPolicyScheduler``, which counts the
iteration about to train from 1): with W warmup steps, decay start S and D decay steps,
iteration s trains with the base LR times

    s / W                        while s < W   (linear warmup: 1/W, 2/W, ... reaching 1 at s = W)
    1                            until s = S   (constant)
    ((D - (s - S)) / D) ** 2     for S <= s < S + D   (power-2 decay: 1 at s = S, ...)
    0                            from s = S + D

(DLRM itself freezes the LR at (W-1)/W between warmup and decay and at 1/D^2 after it; this
project's schedule holds the base LR and decays to 0, as its docstring says.)
"""

from __future__ import annotations

import json

import pytest
import torch
from multiprocess import run_ranks

from dlrm.trainer.checkpoint_format import Part
from dlrm.trainer.optim import WarmupDecayLR

W, S, D = 4, 6, 4  # warmup steps, decay start, decay steps

# By hand, the factor of the base LR each iteration s = 1, 2, ... trains with:
#   s = 1, 2, 3:   1/4, 2/4, 3/4          (warmup)
#   s = 4, 5:      1, 1                   (warmup done, constant)
#   s = 6 .. 9:    (4/4)^2 = 1, (3/4)^2 = 0.5625, (2/4)^2 = 0.25, (1/4)^2 = 0.0625   (decay)
#   s >= 10:       0
BY_HAND = {
    1: 0.25,
    2: 0.5,
    3: 0.75,
    4: 1.0,
    5: 1.0,
    6: 1.0,
    7: 0.5625,
    8: 0.25,
    9: 0.0625,
    10: 0.0,
    11: 0.0,
    12: 0.0,
    13: 0.0,
    14: 0.0,
}


def _optimizer(lrs=(1.0, 0.5)) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in lrs]
    return torch.optim.SGD([{"params": [p], "lr": lr} for p, lr in zip(params, lrs, strict=True)])


def _lrs_by_iteration(
    schedule: WarmupDecayLR, optimizer: torch.optim.Optimizer, first: int, last: int
) -> dict[int, list[float]]:
    """Iteration -> the LR of every group while it trains (the schedule steps after each)."""
    out = {}
    for s in range(first, last + 1):
        out[s] = [g["lr"] for g in optimizer.param_groups]
        schedule.step()
    return out


def test_warmup_rises_linearly_to_the_base_lr_then_holds():
    opt = _optimizer()
    lrs = _lrs_by_iteration(WarmupDecayLR(opt, W, S, D), opt, 1, 6)
    for s in range(1, 7):
        # every group from its own base: 1.0 and 0.5
        assert lrs[s] == pytest.approx([1.0 * BY_HAND[s], 0.5 * BY_HAND[s]], rel=1e-12), s


def test_decay_falls_by_the_square_to_zero_and_stays_there():
    opt = _optimizer()
    lrs = _lrs_by_iteration(WarmupDecayLR(opt, W, S, D), opt, 1, 14)
    decaying = [lrs[s][0] for s in range(S, 15)]
    distinct = [v for i, v in enumerate(decaying) if i == 0 or v != decaying[i - 1]]
    assert distinct == pytest.approx([1.0, 0.5625, 0.25, 0.0625, 0.0])  # (4/4)^2 ... (0/4)^2
    assert all(lrs[s] == [0.0, 0.0] for s in range(11, 15))


def test_decay_starts_at_the_iteration_dlrm_starts_it():
    opt = _optimizer()
    lrs = _lrs_by_iteration(WarmupDecayLR(opt, W, S, D), opt, 1, 14)
    assert [lrs[s][0] for s in range(6, 11)] == pytest.approx([BY_HAND[s] for s in range(6, 11)])


def test_no_warmup_and_no_decay_keeps_the_base_lr():
    opt = _optimizer((0.02,))
    lrs = _lrs_by_iteration(WarmupDecayLR(opt), opt, 1, 50)
    assert all(v == [0.02] for v in lrs.values())


def test_state_dict_resumes_the_schedule_exactly():
    opt = _optimizer()
    uninterrupted = _lrs_by_iteration(WarmupDecayLR(opt, W, S, D), opt, 1, 14)
    first_opt = _optimizer()
    first = WarmupDecayLR(first_opt, W, S, D)
    _lrs_by_iteration(first, first_opt, 1, 7)
    saved = Part(first, rank=0).state_dict()  # the item the checkpoint keeps
    # a fresh process: new optimizer at the configured LRs, new schedule, then the saved state
    resumed_opt = _optimizer()
    resumed = WarmupDecayLR(resumed_opt, W, S, D)
    Part(resumed, rank=0).load_state_dict(saved)
    legacy = WarmupDecayLR(_optimizer(), W, S, D)
    legacy.load_state_dict(json.loads(json.dumps(first.state_dict())))  # format 1 kept it in train_state.json
    assert legacy.step_count == resumed.step_count == 7
    assert _lrs_by_iteration(resumed, resumed_opt, 8, 14) == {s: uninterrupted[s] for s in range(8, 15)}


# ---------------------------------------------------------------- fused embedding groups, for real


def _train_with_schedule(rank: int, world_size: int, iterations: int) -> list[tuple[float, float]]:
    """One rank: a sharded table whose SGD update TorchRec fuses into the embedding kernel, and a
    dense bias, both under the schedule. Per iteration, how far each moved: with loss = sum of
    the pooled row + the bias, each gradient is 1, so the step is the LR in effect."""
    from torchrec import EmbeddingBagCollection, KeyedJaggedTensor
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    from dlrm.trainer.optim import apply_sparse_optimizer, build_optimizer

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(
                tables=[EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["f0"])],
                device=torch.device("meta"),
            )
            self.bias = torch.nn.Parameter(torch.zeros(1))

        def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
            return self.ebc(kjt).values().sum() + self.bias.sum()

    torch.manual_seed(0)
    cfg = {"sparse": {"name": "sgd", "lr": 1.0}, "dense": {"name": "sgd", "lr": 0.5}}
    model = Model()
    apply_sparse_optimizer(model, cfg)
    sharder = EmbeddingBagCollectionSharder()
    plan = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu"),
        constraints={"t0": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])},
    ).collective_plan(model, [sharder], torch.distributed.GroupMember.WORLD)
    model = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    optimizer = build_optimizer(model, cfg)
    schedule = WarmupDecayLR(optimizer, W, S, D)
    assert len(optimizer.param_groups) >= 2  # the fused table's group and the dense group

    def row_and_bias() -> tuple[float, float]:
        state = model.state_dict()
        table = next(v for k, v in state.items() if k.endswith("t0.weight"))
        table = table.local_shards()[0].tensor if hasattr(table, "local_shards") else table.to_local()
        bias = next(v for k, v in state.items() if k.endswith("bias"))
        return float(table[3, 0]), float(bias[0])

    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0"], values=torch.tensor([3]), lengths=torch.tensor([1]))
    steps = []
    for _ in range(iterations):
        before = row_and_bias()
        optimizer.zero_grad()
        model(kjt).backward()
        optimizer.step()
        schedule.step()
        after = row_and_bias()
        steps.append((before[0] - after[0], before[1] - after[1]))
    return steps


def test_the_fused_embedding_update_and_the_dense_update_follow_the_schedule():
    (steps,) = run_ranks(_train_with_schedule, 1, 12)
    for s, (table_step, bias_step) in enumerate(steps, start=1):
        if s <= S:  # warmup and constant: the same in every reading of the schedule
            assert table_step == pytest.approx(1.0 * BY_HAND[s], abs=1e-6), (s, steps)
            assert bias_step == pytest.approx(0.5 * BY_HAND[s], abs=1e-6), (s, steps)
    decaying = [round(t, 6) for t, _ in steps[S - 1 :]]
    assert [v for i, v in enumerate(decaying) if i == 0 or v != decaying[i - 1]] == [1.0, 0.5625, 0.25, 0.0625, 0.0]
    assert [round(b, 6) for _, b in steps[S - 1 :]] == [v / 2 for v in decaying]
