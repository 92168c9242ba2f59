"""The dense gradient all-reduce through our DDP hook (`dense_comm`), on 2 real gloo ranks.

The reference for each option is what people use today, built independently of our code:
stock DMP (TorchRec's DefaultDataParallelWrapper), TorchRec's own fp16 all-reduce precision,
torch's PowerSGD hook registered by hand; DCT is checked against uncompressed training.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

FEATURES = ["cat_0", "cat_1", "cat_2"]
ROWS = [40, 30, 20]
NUM_DENSE = 4
BATCH = 16
# two weight matrices big enough to compress (32 x 4 and 16 x 24 ...) and small bias vectors
MODEL = {"arch": "dlrm", "embedding_dim": 8, "dense_arch_layer_sizes": [32, 8], "over_arch_layer_sizes": [16, 1]}
NONE = {
    "name": "none",
    "kind": "compressed",
    "forward": {"codec": "none", "dedup": False},
    "backward": {"codec": "none", "dedup": False},
}


def _batch(rank: int, step: int) -> Batch:
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.cat([torch.randint(0, n, (BATCH,), generator=g) for n in ROWS])
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=FEATURES, values=ids, lengths=torch.ones(BATCH * len(FEATURES), dtype=torch.int32)
    )
    return Batch(
        dense_features=torch.randn(BATCH, NUM_DENSE, generator=g),
        sparse_features=kjt,
        labels=(torch.rand(BATCH, generator=g) < 0.3).float(),
    )


def _poison(grad: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's gradient with non-finite entries whose sums over 2 ranks are +inf (both +inf),
    NaN (+inf + -inf), NaN (one NaN) and -inf (one -inf plus a finite value)."""
    out = grad.clone()
    out.view(-1)[:4] = torch.tensor(
        [math.inf, math.inf, math.nan, 1.0] if rank == 0 else [math.inf, -math.inf, 1.0, -math.inf]
    )
    return out


def _train(
    rank: int,
    ws: int,
    dense_cfg: dict | None,
    steps: int,
    *,
    lr: float = 0.5,
    wrapper=None,
    torch_hook=None,
    poison: int | None = None,
) -> dict:
    """A small DLRM through the trainer's own model and sharding code; the dense parameters and
    their (all-reduced) gradients after every step. At step ``poison`` the first large weight's
    local gradient gets non-finite entries (:func:`_poison`) and, as torch's GradScaler does,
    that step is skipped."""
    from dlrm.dense_comm.config import parse_dense_comm_cfg
    from dlrm.dense_comm.hook import DenseComm
    from dlrm.dense_comm.wrapper import CompressedDataParallelWrapper
    from dlrm.embedding_comm import make_sharders
    from dlrm.embedding_comm.stats import derive
    from dlrm.process.env import DistEnv
    from dlrm.trainer.model import build_model, table_names
    from dlrm.trainer.optim import apply_sparse_optimizer, build_optimizer
    from dlrm.trainer.sharding import shard_model

    torch.manual_seed(0)
    model = build_model(MODEL, FEATURES, ROWS, NUM_DENSE)
    apply_sparse_optimizer(model, {"sparse": {"name": "sgd", "lr": lr}})
    env = DistEnv(rank, ws, rank, ws, torch.device("cpu"), "gloo")
    dense = DenseComm(parse_dense_comm_cfg(dense_cfg)) if dense_cfg is not None else None
    if wrapper is None and dense is not None:
        wrapper = CompressedDataParallelWrapper(dense)
    model = shard_model(
        model,
        {"type": "table_wise"},
        env,
        make_sharders(NONE),
        BATCH,
        table_names(FEATURES),
        MODEL["embedding_dim"],
        data_parallel_wrapper=wrapper,
    )
    if torch_hook is not None:  # e.g. torch's own PowerSGD hook, registered by hand on DMP's DDP
        model._dmp_wrapped_module.register_comm_hook(*torch_hook(torch.distributed.group.WORLD))
    optimizer = build_optimizer(model, {"dense": {"name": "sgd", "lr": lr}})
    names = [n for n, p in model.named_parameters() if "embedding_bags" not in n]
    params = dict(model.named_parameters())
    grads = []
    local: list[float] = []  # per step: this rank's largest finite |gradient| before the all-reduce
    if poison is not None:
        target = next(n for n in names if params[n].numel() >= 100)
        params[target].register_hook(lambda g: _poison(g, rank) if len(grads) == poison else g)
        for n in names:
            params[n].register_hook(lambda g: local.append(float(g.abs().nan_to_num(0.0, 0.0).amax())))
    for step in range(steps):
        optimizer.zero_grad()
        loss, _ = model(_batch(rank, step))
        loss.backward()
        grads.append({n: params[n].grad.detach().clone() for n in names})
        if step != poison:
            optimizer.step()
    out = {
        "params": {n: params[n].detach().clone() for n in names},
        "grads": grads,
        "local_max": max(local, default=0.0),
    }
    if dense is not None and dense.spec.name == "powersgd":  # a rank's checkpoint, restored in a twin
        from dlrm.dense_comm.hook import DenseComm
        from dlrm.trainer.state import CheckpointError

        buf = io.BytesIO()
        torch.save(dense.state_dict(), buf)
        saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)  # as a resume loads it: plain data
        twin = DenseComm(dense.spec)
        twin.prepare(model._dmp_wrapped_module.module, torch.distributed.group.WORLD)
        twin.load_state_dict(saved)
        out["powersgd_roundtrip"] = _same(twin.state_dict(), saved)
        other = DenseComm(parse_dense_comm_cfg({**dense_cfg, "rank": dense.spec.rank + 1}))
        other.prepare(model._dmp_wrapped_module.module, torch.distributed.group.WORLD)
        try:
            other.load_state_dict(saved)
            out["rank_mismatch"] = "accepted"
        except CheckpointError as e:  # the checkpointer names the checkpoint in it
            out["rank_mismatch"] = str(e)
    if dense is not None:
        out.update(
            stats=derive(*dense.stats.state(run=True)),
            refreshes=list(dense.dct.refreshes) if dense.dct is not None else [],
            residuals=dict(dense.dct.residuals) if dense.dct is not None else {},
            state=dense.state_dict(),
        )
    return out


def _same(a, b) -> bool:
    """Deep equality of state dicts holding tensors, numpy generators and numbers."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "get_state"):
        return all(
            _same(x, y) if not hasattr(x, "shape") else (x == y).all()
            for x, y in zip(a.get_state(), b.get_state(), strict=True)
        )
    return a == b


DCT = {
    "name": "dct",
    "keep": 0.1,
    "refresh_every": 3,
    "refresh_warmup": False,
    "min_numel": 100,
    "bucket_cap_mb": 0.0005,
    # the all-gather's invariants (its residuals alone hold what was not sent); the default
    # reduce-scatter's, owner residuals included: test_dense_aggregation.py
    "aggregation": "allgather",
}


def _variants(rank: int, ws: int) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
    from torchrec.distributed.model_parallel import DefaultDataParallelWrapper

    def powersgd(pg):
        return PowerSGDState(
            process_group=pg,
            matrix_approximation_rank=1,
            start_powerSGD_iter=2,
            min_compression_rate=2,
            use_error_feedback=True,
            warm_start=True,
            random_seed=0,
        ), powerSGD_hook

    small = {"bucket_cap_mb": 0.0005}  # several buckets: the small bias buckets and the matrices
    return {
        "stock": _train(rank, ws, None, 4, wrapper=DefaultDataParallelWrapper()),
        "none": _train(rank, ws, {"name": "none"}, 4),
        "torchrec_fp16": _train(rank, ws, None, 4, wrapper=DefaultDataParallelWrapper(allreduce_comm_precision="fp16")),
        "fp16": _train(rank, ws, {"name": "fp16"}, 4),
        "bf16": _train(rank, ws, {"name": "bf16"}, 4),
        "torch_powersgd": _train(rank, ws, None, 4, wrapper=DefaultDataParallelWrapper(), torch_hook=powersgd),
        "powersgd": _train(rank, ws, {"name": "powersgd", "rank": 1, "start_iter": 2}, 4),
        "dct_keep_all": _train(rank, ws, {"name": "dct", "keep": 1.0, "min_numel": 0}, 4),
        "none_small": _train(rank, ws, {"name": "none", **small}, 7),
        "dct": _train(rank, ws, DCT, 7),
        # learning rate 0: every iteration sees the same weights, so the true gradients are known
        "none_frozen": _train(rank, ws, {"name": "none", **small}, 6, lr=0.0),
        "dct_frozen": _train(rank, ws, {**DCT, "keep": 0.05}, 6, lr=0.0),
    }


@pytest.fixture(scope="module")
def both():
    """Each rank's _variants and _nonfinite, in one job: starting the ranks costs more than most runs."""
    from multiprocess import SharedJob

    return SharedJob({2: {"variants": (_variants,), "nonfinite": (_nonfinite,)}}, per_case_timeout=300)


@pytest.fixture(scope="module")
def runs(both) -> list[dict]:
    return both["variants"]


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_none_is_stock_ddp_bit_for_bit(runs):
    for r in runs:
        assert equal(r["none"]["params"], r["stock"]["params"])
        assert "stats" in r["none"] and r["none"]["stats"] == {}  # no hook: nothing to count


def test_fp16_and_powersgd_are_torchrecs_and_torchs_own_hooks(runs):
    for r in runs:
        assert equal(r["fp16"]["params"], r["torchrec_fp16"]["params"])
        assert not equal(r["fp16"]["params"], r["stock"]["params"])  # the cast did happen
        assert equal(r["powersgd"]["params"], r["torch_powersgd"]["params"])
        assert not equal(r["powersgd"]["params"], r["stock"]["params"])
    assert runs[0]["fp16"]["stats"]["comm/dense/ratio"] == 2.0
    assert runs[0]["powersgd"]["stats"]["comm/dense/ratio"] > 1.5  # rank-1 factors after 2 plain steps


def test_powersgd_state_round_trips_through_a_checkpoint_and_refuses_another_rank(runs):
    for r in runs:
        assert r["powersgd"]["powersgd_roundtrip"] is True
        assert "the checkpoint's PowerSGD factors have rank 1; dense_comm.rank is 2" in r["powersgd"]["rank_mismatch"]


def test_bf16_rounds_to_bfloat16_precision(runs):
    for r in runs:
        got, ref = r["bf16"]["grads"][0], r["stock"]["grads"][0]  # the first step: same weights
        for name in ref:
            # a bf16 rounding (2^-8 relative) of each rank's g/2 and of their sum: errors up to a
            # few 2^-8 of the largest gradient of the tensor (the sum may cancel, so not relative)
            scale = float(ref[name].abs().max())
            torch.testing.assert_close(got[name], ref[name], rtol=0, atol=3 * 2.0**-8 * scale)
        assert not equal(got, ref)
    assert runs[0]["bf16"]["stats"]["comm/dense/ratio"] == 2.0


def test_dct_keeping_everything_is_uncompressed_training(runs):
    for r in runs:
        assert equal(r["dct_keep_all"]["params"], r["stock"]["params"])
        assert all(float(t.abs().max()) == 0.0 for t in r["dct_keep_all"]["residuals"].values())


def test_dct_conserves_gradient_mass_across_ranks_and_iterations(runs):
    # With frozen weights every iteration's true gradients are the uncompressed run's; whatever
    # DCT did not send yet must sit in the residuals: sum of applied + residuals = sum of true.
    ws = len(runs)
    names = runs[0]["none_frozen"]["grads"][0].keys()
    for name in names:
        truth = sum(ws * g[name] for g in runs[0]["none_frozen"]["grads"])
        applied = sum(ws * g[name] for g in runs[0]["dct_frozen"]["grads"])
        left = sum(r["dct_frozen"]["residuals"][name].view_as(truth) for r in runs)
        torch.testing.assert_close(applied + left, truth, rtol=1e-5, atol=1e-6)
    # and it really held gradients back: the residuals of the compressed buckets are not zero
    assert sum(float(t.abs().sum()) for t in runs[0]["dct_frozen"]["residuals"].values()) > 0


def test_dct_refreshes_thresholds_on_schedule_only(runs):
    for r in runs:
        refreshes = r["dct"]["refreshes"]
        names = {name for _, name in refreshes}
        assert len(names) >= 2  # the weight matrices; DDP rebuilds its buckets meanwhile
        for name in names:
            assert [it for it, n in refreshes if n == name] == [0, 3, 6]  # 7 iterations, every 3
        assert set(r["dct"]["state"]["thresholds"]) == names


def test_the_refresh_schedule_warms_up_in_powers_of_two_then_keeps_its_period():
    from dlrm.dense_comm.config import parse_dense_comm_cfg
    from dlrm.dense_comm.hook import DenseComm

    warm = DenseComm(parse_dense_comm_cfg({"name": "dct", "refresh_every": 1000}))
    assert [i for i in range(3001) if warm.dct.refresh_due(i)] == [
        0,
        1,
        2,
        4,
        8,
        16,
        32,
        64,
        128,
        256,
        512,
        1000,
        2000,
        3000,
    ]
    plain = DenseComm(parse_dense_comm_cfg({"name": "dct", "refresh_every": 1000, "refresh_warmup": False}))
    assert [i for i in range(3001) if plain.dct.refresh_due(i)] == [0, 1000, 2000, 3000]


def test_dct_leaves_parameters_under_min_numel_exact(runs):
    r = runs[0]
    params = r["none_small"]["params"]
    small = {n for n, p in params.items() if p.numel() < DCT["min_numel"]}
    large = set(params) - small
    assert small and large and set(r["dct"]["state"]["thresholds"]) == large
    got, ref = r["dct"]["grads"][0], r["none_small"]["grads"][0]  # the first step: same weights
    assert all(torch.equal(got[n], ref[n]) for n in small)
    assert all(not torch.equal(got[n], ref[n]) for n in large)
    assert all(float(r["dct"]["residuals"][n].abs().max()) == 0.0 for n in small)
    stats = r["dct"]["stats"]
    # keep 0.1 of each large parameter's entries (at the refresh; the residuals then grow), all
    # of the small ones that share a bucket with them
    assert 0.1 <= stats["comm/dense/keep"] < 0.3
    assert stats["comm/dense/ratio"] > 1.0 and stats["comm/dense/residual_norm"] > 0


def _nonfinite(rank: int, ws: int) -> dict:
    from torchrec.distributed.model_parallel import DefaultDataParallelWrapper

    keep_all = {"name": "dct", "keep": 1.0, "min_numel": 0}
    return {
        "stock": _train(rank, ws, None, 4, lr=0.0, poison=1, wrapper=DefaultDataParallelWrapper()),
        "exact": _train(rank, ws, keep_all, 4, lr=0.0, poison=1),
        "lossy": _train(rank, ws, {**keep_all, "values": "lossy", "values_eb": 0.01}, 4, lr=0.0, poison=1),
    }


def test_dct_carries_non_finite_gradients_exactly_and_training_goes_on(both):
    # frozen weights: every step's true gradients are stock DDP's of the same step; at step 1 one
    # weight's gradients hold +-inf and NaN on both ranks (:func:`_poison`)
    runs = both["nonfinite"]
    for r in runs:
        stock = r["stock"]["grads"]
        assert not all(bool(g.isfinite().all()) for g in stock[1].values())  # the poison reached DDP
        for step, (exact, lossy, ref) in enumerate(zip(r["exact"]["grads"], r["lossy"]["grads"], stock, strict=True)):
            # sent exactly: stock DDP's all-reduce bit for bit, NaN and inf included, and no NaN
            # left behind in the residuals for the next steps
            for name in ref:
                torch.testing.assert_close(exact[name], ref[name], rtol=0, atol=0, equal_nan=True)
            # lossy values: non-finite entries exactly as stock's; finite ones within the bound,
            # values_eb of each rank's largest |g + residual| now and in the residual of the step
            # before (with a little room for the residual's own size)
            bound = 2 * 0.01 * 1.02 * max(x["lossy"]["local_max"] for x in runs)
            for name in ref:
                finite = ref[name].isfinite()
                torch.testing.assert_close(lossy[name][~finite], ref[name][~finite], rtol=0, atol=0, equal_nan=True)
                assert bool(lossy[name][finite].isfinite().all()), (step, name)
                err = float((lossy[name][finite] - ref[name][finite]).abs().max())
                assert err <= bound, (step, name, err, bound)
        assert not equal(r["lossy"]["grads"][3], stock[3])  # the values were coded
        assert all(bool(t.isfinite().all()) for t in r["lossy"]["residuals"].values())


# --------------------------------------------------------------------------- through the trainer


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize(
    "dense",
    [
        ["dense_comm=dct", "dense_comm.keep=0.05", "dense_comm.refresh_every=4", "dense_comm.min_numel=64"],
        # the segment owners' residuals come back too
        ["dense_comm=dct", "dense_comm.keep=0.05", "dense_comm.min_numel=64", "dense_comm.aggregation=reduce_scatter"],
        # MLPs over DDP's 1 MB first bucket: the rebuilt layout (2 buckets) differs from the first
        ["dense_comm=powersgd", "dense_comm.start_iter=2", "model.dense_arch_layer_sizes=[512,512,16]"],
    ],
    ids=["dct", "dct_reduce_scatter", "powersgd"],
)
def test_the_trainer_resumes_a_dense_hook_and_reports_it(tmp_path, cache, dense):
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from trainer_runs import losses, resume_from, train

    full, part = tmp_path / "full", tmp_path / "part"
    # saved at 5, 10 and 12, all kept: part resumes from full's step-5
    common = ["loss_log=true", "checkpoint.every=5", "checkpoint.keep=3", "compression=none", *dense]
    train(full, cache, [*common, "max_iterations=12"])
    resume_from(full, part, 5)
    train(part, cache, [*common, "max_iterations=12", "resume=true"])
    reference, resumed = losses(full), losses(part)
    assert sorted(resumed) == list(range(6, 13))  # it trained from step-5 on, nothing before
    assert resumed[6] == reference[6]  # the weights and optimizer came back
    if "dense_comm=dct" in dense:
        # the residuals and thresholds came back: the same losses after the resume
        assert [resumed[i] for i in range(6, 13)] == [reference[i] for i in range(6, 13)]
    else:
        # PowerSGD's first step in a new process is a plain all-reduce (its state is keyed by DDP's
        # rebuilt buckets); training goes on from the restored factors and error feedback
        assert [resumed[i] for i in range(7, 13)] == pytest.approx([reference[i] for i in range(7, 13)], rel=0.05)
    metrics = json.loads((full / "metrics.json").read_text())
    assert metrics["dense_comm"] == dense[0].split("=")[1] and metrics["dense_ratio"] > 1.5
    tags = set(EventAccumulator(str(full / "tensorboard")).Reload().Tags()["scalars"])
    assert {"comm/dense/ratio", "comm/dense/codec_ms", "comm/dense/comm_ms"} <= tags
    if "dense_comm=dct" in dense:
        assert {"comm/dense/keep", "comm/dense/threshold", "comm/dense/residual_norm"} <= tags


def _corrupt_dense_payloads(rank: int, ws: int) -> str:
    from dlrm.process.instrument import set_payload_hook

    def flip(payload: torch.Tensor, *, src: int, dst: int, direction: str, iteration: int) -> torch.Tensor:
        if direction == "dense" and iteration == 1:  # every rank's, so that no rank waits on another
            payload = payload.clone()
            payload[payload.numel() // 2] ^= 0x10
        return payload

    set_payload_hook(flip)
    try:
        _train(rank, ws, DCT, 3)
    except Exception as e:  # report the error text to the parent
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_a_corrupted_dense_payload_is_an_error_naming_ranks_bucket_and_iteration():
    from multiprocess import run_ranks

    errors = run_ranks(_corrupt_dense_payloads, 2, timeout=300)
    for rank, error in enumerate(errors):
        other = 1 - rank
        assert f"rank {rank}: cannot decode the dense gradient payload of bucket" in error, error
        assert f"from rank {other} at iteration 1" in error and "PayloadError" in error


def test_dense_fallback_is_one_of_autos_options_and_read_by_auto_only():
    """``dense_comm.fallback`` (what travels while auto calibrates): a switchable option, named in errors."""
    from dlrm.dense_comm.config import parse_dense_comm_cfg

    with pytest.raises(ValueError, match=r"dense_comm\.fallback must be one of none, fp16, bf16, dct"):
        parse_dense_comm_cfg({"name": "auto", "fallback": "powersgd"})  # needs warm-up: not switched to
    with pytest.raises(ValueError, match="fallback"):
        parse_dense_comm_cfg({"name": "dct", "fallback": "dct"})
