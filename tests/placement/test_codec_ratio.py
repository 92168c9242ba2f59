"""A codec's ratio as the placement prices it (hot-row replication, comm_aware): checked against
ratios measured independently, by TorchRec's own QComms codec on real table rows and by a real
2-rank training run of the same config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs
from trainer_runs import train

from data.frequency import read_frequency
from dlrm.embedding_comm import build_sharders, compression_runtime
from dlrm.embedding_comm.config import parse_compression_cfg
from dlrm.placement.codec_ratio import priced_directions
from dlrm.placement.traffic import Shard, TablePlacement, TrafficModel, by_path

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "compression"


def _spec(name: str):
    return parse_compression_cfg(OmegaConf.load(CONFIGS / f"{name}.yaml"))


def _torchrec_ratio(precision: str, dim: int) -> float:
    """fp32 bytes / the bytes TorchRec's QComms codec sends for rows of an initialised table."""
    codec = get_qcomm_codecs(QCommsConfig(forward_precision=CommType(precision))).forward
    rows = torch.nn.init.uniform_(torch.empty(256, dim), -0.05, 0.05)
    payload = codec.encode(rows, codec.create_context())
    return rows.numel() * 4 / (payload.numel() * payload.element_size())


@pytest.mark.parametrize("name, precision", [("qcomm_int8", "int8"), ("qcomm_bf16", "bf16"), ("qcomm_fp16", "fp16")])
def test_hot_rows_price_qcomm_at_the_ratio_torchrec_sends(name, precision):
    forward, backward = priced_directions(_spec(name), None, [], [], batch=256, dim=64, seed=0)
    assert forward.ratio_ids == backward.ratio_rows == pytest.approx(_torchrec_ratio(precision, 64), rel=1e-6)
    assert not forward.dedup and not forward.framed  # TorchRec's own all-to-all: one row per bag, no sizes


@pytest.mark.parametrize("name", ["int8", "dct_mp", "fp16"])
def test_priced_forward_bytes_match_what_a_run_of_the_config_sends(name, tmp_path):
    """The ratio priced before training, through the traffic model, against the forward bytes a
    real 2-rank table-wise run counted on its wire."""
    run = tmp_path / name
    train(run, tmp_path / "cache", [f"compression={name}", "sharding=table_wise", "max_iterations=4", "batch_size=64"])
    metrics = json.loads((run / "metrics.json").read_text())
    (meta,) = (tmp_path / "cache").glob("*/meta.json")
    info = json.loads(meta.read_text())
    features, freqs = info["sparse_features"], read_frequency(info)
    spec = _spec(name)
    forward, backward = priced_directions(spec, compression_runtime(build_sharders(spec)), features, freqs, 64, 16, 0)
    tables = []
    for f, n in zip(features, info["num_embeddings"], strict=True):
        kind, ranks = metrics["sharding_plan"][f"t_{f}"].split(" ranks=")
        tables.append(TablePlacement(f"t_{f}", kind, n, 16, (Shard(json.loads(ranks)[0], 0, n, 16),)))
    model = TrafficModel(2, 64, forward=forward, backward=backward)
    predicted = model.plan(tables, {f"t_{f}": q for f, q in zip(features, freqs, strict=True)})
    assert by_path(predicted)["forward"] == pytest.approx(metrics["wire_bytes_by_path"]["forward"], rel=0.1)
