"""Bounds that follow training (issue 38): the plateau (tightening as validation AUC flattens), the
window of iterations a rule compresses in, and exact evaluation forwards."""

from __future__ import annotations

import json

import pytest
import torch

from dlrm.embedding_comm.policy import TrainingBound, build_policy
from dlrm.trainer.checkpoint_format import Part
from dlrm_compression.policies import Plateau, PlateauState, TableStats, plateau_update

TABLES = [TableStats("cat_0", 100, 8), TableStats("cat_1", 10, 8)]
PLATEAU = {"factor": 0.5, "min_delta": 0.001, "patience": 1, "floor": 0.25}


def cfg(forward: dict, backward: dict | None = None) -> dict:
    return {"name": "p", "forward": forward, "backward": backward or {"kind": "fixed", "eb": 0.01}}


def test_plateau_tightens_after_flat_passes_down_to_its_floor():
    p = Plateau(factor=0.5, min_delta=0.001, patience=2, floor=0.25)
    s = PlateauState()
    levels = []
    # rises by 0.01 (improved), 0.0005 (flat), 0.0005 (flat again: the 2nd, tighten), then falls
    for auc in (0.70, 0.71, 0.7105, 0.7110, 0.705, 0.704, None, 0.703, 0.702):
        s = plateau_update(s, auc, p)
        levels.append(s.level)
    assert levels == [1.0, 1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.25, 0.25]
    assert s.best == 0.7110  # the best so far, flat passes measured against it


def test_plateau_policy_scales_each_direction_it_is_given_and_checkpoints():
    dual = {"kind": "dual", "classes": {"source": "auto"}, "schedule": {"kind": "step", "early_stage": 1000}}
    p = build_policy(cfg({**dual, "plateau": PLATEAU}), TABLES)
    before = p.bounds("forward", 10)
    assert p.validated(0.80) == {"forward": 1.0}
    assert p.validated(0.8005) == {"forward": 0.5}  # flat: halved, backward (no plateau) untouched
    assert p.bounds("forward", 10) == {f: pytest.approx(v / 2) for f, v in before.items()}
    assert p.bound("cat_0", "backward", 10) == 0.01
    q = build_policy(cfg({**dual, "plateau": PLATEAU}), TABLES)
    Part(q, rank=0).load_state_dict(Part(p, rank=0).state_dict())  # the item the checkpoint keeps
    assert q.bounds("forward", 10) == p.bounds("forward", 10)
    legacy = build_policy(cfg({**dual, "plateau": PLATEAU}), TABLES)
    legacy.load_state_dict(json.loads(json.dumps(p.state_dict())))  # format 1 kept it in train_state.json
    assert legacy.bounds("forward", 10) == p.bounds("forward", 10)
    assert p.summary()["policy_forward_level"] == 0.5
    with pytest.raises(ValueError, match="no plateau there"):
        build_policy(cfg({"kind": "fixed", "eb": 0.01}), TABLES).load_state_dict(p.state_dict())


def test_window_sends_exactly_outside_it_and_evaluation_exact_only_without_grad():
    p = build_policy(
        cfg(
            {"kind": "fixed", "eb": 0.02, "window": {"start": 10, "end": 20}, "evaluation": "exact"},
            {"kind": "fixed", "eb": 0.01, "window": {"start": 15}},
        ),
        TABLES,
    )
    assert [p.bound("cat_0", "forward", it) for it in (0, 9, 10, 19, 20)] == [0.0, 0.0, 0.02, 0.02, 0.0]
    assert [p.bound("cat_0", "backward", it) for it in (14, 15, 10**6)] == [0.0, 0.01, 0.01]
    bound, model = TrainingBound(p), torch.nn.Linear(1, 1)
    assert bound("cat_0", "forward", 12) == 0.02
    bound.segment_start(model)
    with torch.no_grad():  # the all-to-all runs in an autograd function's forward: no grad mode in training too
        assert bound("cat_0", "forward", 12) == 0.02
    bound.segment_end(model)  # evaluation passes happen between training segments
    assert bound("cat_0", "forward", 12) == 0.0
    assert bound("cat_0", "backward", 16) == 0.01
    bound.segment_start(model)
    assert bound("cat_0", "forward", 12) == 0.02


@pytest.mark.parametrize(
    "forward, backward, message",
    [
        ({"kind": "fixed", "eb": 0.01, "plateau": {"factor": 1.5}}, None, r"policy\.forward\.plateau: .*factor"),
        ({"kind": "fixed", "eb": 0.01, "plateau": {"speed": 1}}, None, r"policy\.forward\.plateau: unknown key"),
        ({"kind": "fixed", "eb": 0.01, "window": {"start": 5, "end": 5}}, None, r"policy\.forward\.window\.end"),
        ({"kind": "fixed", "eb": 0.01, "evaluation": "loose"}, None, r"policy\.forward\.evaluation must be"),
        ({"kind": "fixed", "eb": 0.01}, {"kind": "fixed", "eb": 0.01, "evaluation": "exact"}, "forward only"),
        (
            {
                "kind": "closed_loop",
                "eb": 0.01,
                "control": {"target": 0.01, "min": 0.001, "max": 0.1},
                "plateau": {},
            },
            None,
            r"policy\.forward\.plateau: the closed loop",
        ),
    ],
)
def test_bad_adaptive_keys_name_the_key(forward, backward, message):
    with pytest.raises(ValueError, match=message):
        build_policy(cfg(forward, backward), TABLES)


def _forwards_on_ranks(rank: int, ws: int) -> dict:
    """Rank 0 owns both tables; rank 1's pooled rows arrive through the compressed all-to-all:
    once in a training segment (grad mode on, no backward), once after it (an evaluation)."""
    from torch import nn
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    from dlrm.embedding_comm import make_sharders

    features = ["cat_0", "cat_1"]
    policy = build_policy(cfg({"kind": "fixed", "eb": 0.05, "evaluation": "exact"}), TABLES)
    bound = TrainingBound(policy)
    comp = {"name": "lossy", "forward": {"codec": "lossy", "mode": "rel"}, "backward": {"codec": "lossy"}}
    sharders = make_sharders(comp, bound_fn_forward=bound, bound_fn_backward=bound)
    tables = [
        EmbeddingBagConfig(name=f"t_{f}", embedding_dim=8, num_embeddings=100, feature_names=[f]) for f in features
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    plan = construct_module_sharding_plan(
        ebc, {f"t_{f}": table_wise(rank=0) for f in features}, local_size=ws, world_size=ws, device_type="cpu"
    )
    model = DistributedModelParallel(
        nn.ModuleDict({"ebc": ebc}),
        env=ShardingEnv.from_process_group(torch.distributed.group.WORLD),
        plan=ShardingPlan({"ebc": plan}),
        sharders=sharders,
        device=torch.device("cpu"),
    )
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=features, values=torch.arange(2 * 32) % 100, lengths=torch.ones(2 * 32, dtype=torch.int32)
    )

    def forward() -> torch.Tensor:
        return model.module["ebc"](kjt).values().detach().clone()

    bound.segment_start(model)
    trained = forward()  # grad mode on: the all-to-all itself runs inside an autograd function
    bound.segment_end(model)
    with torch.no_grad():
        evaluated = forward()
    return {"trained": trained, "evaluated": evaluated}


def test_training_forwards_are_compressed_and_evaluation_forwards_exact_through_real_all_to_alls():
    from multiprocess import run_ranks

    results = run_ranks(_forwards_on_ranks, 2)
    own, received = results[0], results[1]
    assert torch.equal(own["trained"], own["evaluated"])  # rank 0's own rows never travel
    diff = (received["trained"] - received["evaluated"]).abs()
    span = received["evaluated"].max() - received["evaluated"].min()
    assert 0 < diff.max() <= 0.05 * span + 1e-6  # compressed in training, within its bound of the exact rows
