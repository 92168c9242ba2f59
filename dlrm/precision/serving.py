"""The serving model and its files: a trained DLRM whose tables are row-wise quantized with
TorchRec's quantized EmbeddingBagCollection (int8, int4, fp16 or fp32, chosen per table) and
whose MLPs are fp32 or bf16; one process, no sharding, no process group.

A directory written by :func:`save` (read back by :func:`load`) holds two files:

* ``model.json``: ``{"format": "dlrm-compress-serving", "version": 1, "model": {arch and layer
  sizes, as the run's model config}, "dense_in_features": N, "dense_precision": "fp32" | "bf16",
  "tables": [{"name", "feature", "num_embeddings", "embedding_dim", "precision"}, ...]}``, the
  tables in the order of the model's sparse features.
* ``model.pt`` (plain tensors: ``torch.load(path, weights_only=True)`` reads it): ``{"tables":
  {name: {"rows": uint8 [num_embeddings, bytes per row], "scale_bias": uint8 [num_embeddings, 4]
  or None}}, "dense": {key: tensor}}``. The rows are FBGEMM's row-wise formats, what TorchRec's
  ``QuantEmbeddingBagCollection.from_float`` produces: int8 one byte and int4 half a byte per
  value, each row decoded as ``scale * q + bias`` with the row's fp16 scale and bias in
  ``scale_bias``; fp16 and fp32 rows hold the values' bytes (``scale_bias`` None). ``dense`` is
  the state dict of TorchRec's DLRM without ``sparse_arch`` (bottom MLP, interaction, top MLP),
  stored in the dense precision.

The model's input is what the run's loader yields: log-transformed dense features [B, N] and a
KeyedJaggedTensor of the categorical ids (one id per feature and row, already hashed to the
table's rows); its output, fp32 logits [B].
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig, dtype_to_data_type
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.quant.embedding_modules import DEFAULT_ROW_ALIGNMENT, quantize_state_dict
from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dlrm.trainer.model import build_dlrm, dense_logits

FORMAT, VERSION = "dlrm-compress-serving", 1
TABLE_PRECISIONS = {"fp32": torch.float, "fp16": torch.half, "int8": torch.quint8, "int4": torch.quint4x2}
DENSE_PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}
QuantizedRows = dict[str, tuple[torch.Tensor, torch.Tensor | None]]


@dataclass(frozen=True)
class TableSpec:
    name: str
    feature: str
    num_embeddings: int
    embedding_dim: int
    precision: str

    def fp32_bytes(self) -> int:
        return self.num_embeddings * self.embedding_dim * 4


@dataclass(frozen=True)
class ServingSpec:
    """What ``model.json`` holds: enough to rebuild the model around the saved tensors."""

    model: dict[str, Any]
    dense_in_features: int
    dense_precision: str
    tables: tuple[TableSpec, ...]

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], where: str) -> ServingSpec:
        if obj.get("format") != FORMAT or obj.get("version") != VERSION:
            raise ValueError(
                f"{where}: not a {FORMAT} v{VERSION} model "
                f"(format {obj.get('format')!r}, version {obj.get('version')!r})"
            )
        tables = tuple(TableSpec(**t) for t in obj["tables"])
        return cls(dict(obj["model"]), int(obj["dense_in_features"]), obj["dense_precision"], tables)


def check_plan(plan: Mapping[str, str], tables: list[str], where: str) -> None:
    """Every table has a known precision, and the plan names no other table."""
    unknown = sorted(set(plan) - set(tables))
    if unknown:
        raise ValueError(f"{where}: no table named {unknown}; the model's tables are {tables}")
    for table in tables:
        if plan.get(table) not in TABLE_PRECISIONS:
            raise ValueError(
                f"{where}: table {table} has precision {plan.get(table)!r}; choose one of {list(TABLE_PRECISIONS)}"
            )


class ServingDLRM(nn.Module):
    """TorchRec's DLRM over a quantized EmbeddingBagCollection; ``forward(dense, kjt) -> logits``."""

    def __init__(self, model: DLRM, spec: ServingSpec) -> None:
        super().__init__()
        self.model, self.spec = model, spec
        self.dense_dtype = DENSE_PRECISIONS[spec.dense_precision]

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        return dense_logits(self.model, dense_features, sparse_features, self.dense_dtype, dense_features.device.type)


def quantize_rows(trained: EmbeddingBagCollection, plan: Mapping[str, str]) -> QuantizedRows:
    """The tables of ``trained`` (fp32 or fp16 rows) at the precisions of ``plan`` (table ->
    precision): TorchRec's conversion, ``quantize_state_dict``, the first half of
    ``QuantEmbeddingBagCollection.from_float`` (the constructor in :func:`build` is the second)."""
    data_types = {c.name: dtype_to_data_type(TABLE_PRECISIONS[plan[c.name]]) for c in trained.embedding_bag_configs()}
    rows: QuantizedRows = {}
    quantize_state_dict(trained, rows, data_types)
    return {name: (w.contiguous(), None if sb is None else sb.contiguous()) for name, (w, sb) in rows.items()}


def dense_state(trained: DLRM, precision: str) -> dict[str, torch.Tensor]:
    """The state of the dense part of ``trained`` (no tables), cast to the dense precision."""
    dtype = DENSE_PRECISIONS[precision] or torch.float
    return {k: v.detach().to(dtype) for k, v in trained.state_dict().items() if not k.startswith("sparse_arch.")}


def build(
    spec: ServingSpec, rows: QuantizedRows, dense: Mapping[str, torch.Tensor], device: torch.device | str = "cpu"
) -> ServingDLRM:
    """The serving model of ``spec`` around quantized ``rows`` (table -> (rows, scale_bias)) and the
    ``dense`` state."""
    device = torch.device(device)
    configs = [
        EmbeddingBagConfig(
            name=t.name,
            embedding_dim=t.embedding_dim,
            num_embeddings=t.num_embeddings,
            feature_names=[t.feature],
            data_type=dtype_to_data_type(TABLE_PRECISIONS[t.precision]),
        )
        for t in spec.tables
    ]
    ebc = QuantEmbeddingBagCollection(
        configs,
        is_weighted=False,
        device=device,
        table_name_to_quantized_weights={t.name: rows[t.name] for t in spec.tables},
        # FBGEMM's own CPU default; TorchRec's 16 would pad an int8 row of 32 values (36 bytes) to 48
        row_alignment=1 if device.type == "cpu" else DEFAULT_ROW_ALIGNMENT,
    )
    model = build_dlrm(spec.model, ebc, spec.dense_in_features)
    dense_modules = nn.ModuleList([model.dense_arch, model.inter_arch, model.over_arch])
    dense_modules.to(device=device, dtype=DENSE_PRECISIONS[spec.dense_precision] or torch.float)
    missing, unexpected = model.load_state_dict(dense, strict=False)
    missing = [k for k in missing if not k.startswith("sparse_arch.")]
    if missing or unexpected:
        raise ValueError(f"dense state does not fit model {spec.model}: missing {missing}, unexpected {unexpected}")
    return ServingDLRM(model, spec).eval()


def size_bytes(rows: QuantizedRows, dense: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    """(bytes of the tables, bytes of the whole model) as stored and held in CPU memory."""
    tables = sum(t.numel() * t.element_size() for pair in rows.values() for t in pair if t is not None)
    return tables, tables + sum(t.numel() * t.element_size() for t in dense.values())


def save(out_dir: Path, spec: ServingSpec, rows: QuantizedRows, dense: Mapping[str, torch.Tensor]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tables = {name: {"rows": r, "scale_bias": sb} for name, (r, sb) in rows.items()}
    torch.save({"tables": tables, "dense": dict(dense)}, out_dir / "model.pt")
    (out_dir / "model.json").write_text(json.dumps(spec.to_json(), indent=2) + "\n")


def load(out_dir: Path | str, device: torch.device | str = "cpu") -> ServingDLRM:
    """The serving model saved in ``out_dir`` by :func:`save`."""
    out_dir = Path(out_dir)
    spec_file, tensor_file = out_dir / "model.json", out_dir / "model.pt"
    for f in (spec_file, tensor_file):
        if not f.exists():
            raise FileNotFoundError(f"{f} is missing: {out_dir} is not a model written by dlrm-export")
    spec = ServingSpec.from_json(json.loads(spec_file.read_text()), str(spec_file))
    saved = torch.load(tensor_file, weights_only=True, map_location="cpu")
    rows = {name: (t["rows"], t["scale_bias"]) for name, t in saved["tables"].items()}
    return build(spec, rows, saved["dense"], device)
