"""The `precision` group in training: fp16 tables in FBGEMM's fused kernel and bf16 MLPs under
autocast, on 2 gloo ranks, resumed exactly; the config's validation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from run_artifacts import checkpoint_tensors, flatten
from torchrec.datasets.utils import Batch
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from trainer_runs import resumed_losses

from dlrm.precision.config import parse_precision_cfg
from dlrm.precision.export import main
from dlrm.trainer.model import MixedPrecisionDLRMTrain, build_dlrm, embedding_configs

DIM = 16  # trainer_runs.SMALL's embedding dim


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def test_fp16_tables_and_bf16_mlps_train_on_two_ranks_and_resume_exactly(tmp_path, cache):
    full, part = tmp_path / "full", tmp_path / "part"
    common = ["precision=mixed", "loss_log=true", "checkpoint.every=4", "eval_every=100"]
    reference, resumed = resumed_losses(full, part, cache, common, stop=8, total=12)
    # the resumed run trained 9 .. 12 only (from the full run's step-8)
    assert sorted(resumed) == list(range(9, 13)) and all(math.isfinite(v) for v in reference.values())
    assert [resumed[i] for i in range(9, 13)] == [reference[i] for i in range(9, 13)]

    metrics = json.loads((full / "metrics.json").read_text())
    assert metrics["precision"] == {"embeddings": "fp16", "dense": "bf16"}
    assert 0.5 < metrics["auc"] < 1 and metrics["logloss"] < math.log(2)
    # no table is data-parallel (plain fp16 parameters outside the fused kernel: the loss went NaN)
    assert not [t for t, p in metrics["sharding_plan"].items() if p.startswith("data_parallel")]
    # the checkpoint holds the tables as fp16 rows, the MLPs' master weights as fp32
    saved = flatten(checkpoint_tensors(full / "checkpoints" / "step-12"))
    tables = {k: v for k, v in saved.items() if k.startswith("model/") and ".embedding_bags." in k}
    mlps = {k: v for k, v in saved.items() if k.startswith("model/") and "_arch." in k and "sparse_arch" not in k}
    assert len(tables) == 26 and {v.dtype for v in tables.values()} == {torch.float16}
    assert mlps and {v.dtype for v in mlps.values()} == {torch.float32}
    # every row once (each table on one rank or split across both), at 2 bytes a value
    assert sum(metrics["embedding_bytes_per_rank"]) == sum(v.numel() for v in tables.values()) * 2
    assert len(metrics["embedding_bytes_per_rank"]) == 2 and min(metrics["embedding_bytes_per_rank"]) > 0

    # served at fp16, the fp16-trained rows are the trained model's exactly (MLPs at fp32 in both)
    main([str(full), "--precision", "fp16", "--out", str(tmp_path / "served")])
    served = json.loads((tmp_path / "served" / "export.json").read_text())
    assert served["auc"] == served["fp32_auc"] and served["logloss"] == pytest.approx(served["fp32_logloss"], abs=1e-9)
    assert served["table_bytes"] == sum(v.numel() for v in tables.values()) * 2


def _model(dense: str) -> MixedPrecisionDLRMTrain:
    torch.manual_seed(0)
    tables = EmbeddingBagCollection(tables=embedding_configs(["a", "b"], [10, 20], 8), device=torch.device("cpu"))
    cfg = {"arch": "dlrm", "embedding_dim": 8, "dense_arch_layer_sizes": [16, 8], "over_arch_layer_sizes": [16, 1]}
    return MixedPrecisionDLRMTrain(build_dlrm(cfg, tables, 4), parse_precision_cfg({"dense": dense}).dense_dtype)


def test_bf16_dense_runs_the_mlps_in_bf16_and_keeps_fp32_weights_and_logits():
    fp32, bf16 = _model("fp32"), _model("bf16")
    ids = KeyedJaggedTensor.from_lengths_sync(
        ["a", "b"], torch.tensor([1, 2, 3, 4, 5, 6]), torch.ones(6, dtype=torch.int)
    )
    batch = Batch(dense_features=torch.randn(3, 4), sparse_features=ids, labels=torch.tensor([0, 1, 1]))
    seen = {}
    bf16.model.dense_arch.register_forward_hook(lambda m, i, o: seen.update(bottom=o.dtype))
    bf16.model.over_arch.register_forward_hook(lambda m, i, o: seen.update(top=o.dtype))
    loss, (_, logits, _) = bf16(batch)
    _, (_, want, _) = fp32(batch)
    assert seen == {"bottom": torch.bfloat16, "top": torch.bfloat16}
    assert logits.dtype == torch.float32 and not torch.equal(logits, want)
    assert torch.allclose(logits, want, atol=0.05)  # bf16 keeps 8 bits of mantissa
    loss.backward()
    assert {p.dtype for p in bf16.parameters()} == {torch.float32}
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in bf16.model.over_arch.parameters())


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"embeddings": "fp8"}, "precision.embeddings must be one of fp16, fp32, got 'fp8'"),
        ({"dense": "fp16"}, "precision.dense must be one of bf16, fp32, got 'fp16'"),
        ({"tables": "fp16"}, "precision: unknown key(s) ['tables']"),
    ],
)
def test_bad_precision_config_names_the_key(cfg, message):
    with pytest.raises(ValueError) as e:
        parse_precision_cfg(cfg)
    assert message in str(e.value)
