"""`dlrm-export RUN_DIR --precision int8 --out OUT_DIR`: a trained run -> a quantized serving model.

Reads the run's config (``RUN_DIR/.hydra/config.yaml``) and its newest checkpoint, rebuilds whole
tables from the DCP shards (DCP stores each tensor's global shape and the offsets of every rank's
piece, so this holds for every sharding type), quantizes the tables per table with TorchRec
(:mod:`dlrm.precision.serving`), saves the model, evaluates it and the fp32 model on the run's test split,
and writes ``OUT_DIR/export.json``. ``--max-auc-drop X`` makes the AUC lost against fp32 a gate
(exit status 1, naming the costliest tables); ``--search`` picks per-table precisions under it
(:mod:`dlrm.precision.search`).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig, OmegaConf
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from dlrm.placement.hot_rows import fold_into_tables
from dlrm.precision import serving
from dlrm.precision.search import PlanEvaluator, costliest_tables, search_plan
from dlrm.process.env import DistEnv
from dlrm.trainer.checkpoint import checked_steps
from dlrm.trainer.checkpoint_format import METADATA, damage, read_state
from dlrm.trainer.datasets import RunData
from dlrm.trainer.evaluation import Evaluator
from dlrm.trainer.model import build_dlrm, embedding_configs

MODEL_PREFIX = "model.model."  # checkpoint key of DLRM's state: DMP's "model" entry, DLRMTrain.model
PRECISIONS = list(serving.TABLE_PRECISIONS)
OUTPUT_DIR = "${hydra:runtime.output_dir}"  # the run directory, in the saved config


def run_config(run_dir: Path) -> DictConfig:
    path = run_dir / ".hydra" / "config.yaml"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: {run_dir} is not the run directory of a dlrm-train run")
    return OmegaConf.load(path)  # type: ignore[return-value]


def checkpoint_root(run_dir: Path, cfg: DictConfig) -> Path:
    """``checkpoint.dir`` as the run resolved it, from its saved config: ``${hydra:runtime.output_dir}``
    is the run directory (wherever it is now), a relative path is relative to where the run started."""
    raw = str(cast(dict, OmegaConf.to_container(cfg.checkpoint, resolve=False))["dir"])
    try:
        text = OmegaConf.merge(cfg, {"checkpoint": {"dir": raw.replace(OUTPUT_DIR, str(run_dir))}}).checkpoint.dir
    except Exception as e:  # another ${hydra:...} key: only the trainer's Hydra knows it
        raise ValueError(
            f"{run_dir / '.hydra' / 'config.yaml'}: checkpoint.dir={raw!r} cannot be resolved outside the run ({e}); "
            "name the step with --checkpoint DIR"
        ) from None
    path = Path(text)
    if path.is_absolute():
        return path
    hydra_file = run_dir / ".hydra" / "hydra.yaml"
    started = OmegaConf.select(OmegaConf.load(hydra_file), "hydra.runtime.cwd") if hydra_file.exists() else None
    if started is None:
        raise ValueError(f"checkpoint.dir={raw!r} is relative and {hydra_file} does not say where the run started")
    return Path(started) / path


def checkpoint_step(run_dir: Path, cfg: DictConfig, explicit: str | None = None) -> Path:
    """The step to export, chosen as a resume would: ``explicit``, or the newest complete step whose
    files match their checksums (a damaged newer one is named on stderr and passed over)."""
    if explicit:
        found = damage(Path(explicit), 0, 1)
        if found:
            raise ValueError(f"--checkpoint {explicit} is damaged: {'; '.join(found)}")
        return Path(explicit)
    root, damaged = checkpoint_root(run_dir, cfg), list[str]()
    for step, found in checked_steps(root):
        if not found:
            if damaged:
                print(f"dlrm-export: passed over damaged checkpoints: {'; '.join(damaged)}", file=sys.stderr)
            return step
        damaged.extend(found)
    if damaged:
        raise ValueError(f"{root} holds no intact checkpoint: {'; '.join(damaged)}")
    raise FileNotFoundError(f"{root} holds no complete checkpoint (a step-N/ with {METADATA})")


def load_dlrm_state(step_dir: Path) -> dict[str, torch.Tensor]:
    """DLRM's whole state (tables unsharded) from a DCP checkpoint, in this one process."""
    meta = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    state = {
        key: torch.empty(m.size, dtype=m.properties.dtype)
        for key, m in meta.items()
        if key.startswith(MODEL_PREFIX) and isinstance(m, TensorStorageMetadata)
    }
    if not state:
        raise ValueError(f"{step_dir}: no '{MODEL_PREFIX}*' tensors; not a checkpoint of dlrm-train")
    with warnings.catch_warnings():  # "no process group": intended, this is one process
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(step_dir), no_dist=True)
    return {key[len(MODEL_PREFIX) :]: t for key, t in state.items()}


def hot_ids_of(step_dir: Path) -> dict[str, list[int]]:
    """The ids a run replicated (placement.hot_rows), as rank 0's hot_rows part records them."""
    return dict(read_state(step_dir, 0).parts.get("hot_rows", {}).get("hot_ids", {}))


def trained_model(cfg: DictConfig, data: RunData, state: Mapping[str, torch.Tensor]) -> DLRM:
    """The run's DLRM on CPU with fp32 tables (fp16-trained rows widened exactly) and its MLPs."""
    configs = embedding_configs(data.features, data.num_embeddings, int(cfg.model.embedding_dim))
    model = build_dlrm(cfg.model, EmbeddingBagCollection(tables=configs, device=torch.device("cpu")), data.num_dense)
    model.load_state_dict({k: v.float() for k, v in state.items()})
    return model.eval()


@torch.no_grad()
def evaluate(predict: Any, batches: Sequence[Any]) -> dict[str, Any]:
    """AUC, log loss and accuracy of ``predict(dense, kjt) -> logits`` over ``batches``."""
    evaluator = Evaluator(torch.device("cpu"))
    for batch in batches:
        evaluator.update(predict(batch.dense_features, batch.sparse_features).reshape(-1), batch.labels)
    return evaluator.compute("test")


def parse_plan(args: argparse.Namespace, tables: list[str]) -> dict[str, str]:
    """Per-table precisions: ``--precision`` for all, then ``--plan FILE`` and ``--table NAME=P``."""
    plan = dict.fromkeys(tables, args.precision)
    if args.plan:
        where = str(args.plan)
        try:
            loaded = json.loads(Path(args.plan).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"--plan {where}: cannot read a JSON plan ({e})") from e
        plan.update(loaded.get("precision", loaded))  # a plan.json or an export.json
    for item in args.table:
        name, sep, precision = item.partition("=")
        if not sep:
            raise ValueError(f"--table {item!r}: expected TABLE=PRECISION, e.g. --table {tables[0]}=int4")
        plan[name] = precision
    serving.check_plan(plan, tables, "dlrm-export")
    return plan


def export(args: argparse.Namespace) -> dict[str, Any]:
    run_dir = Path(args.run_dir)
    cfg = run_config(run_dir)
    step_dir = checkpoint_step(run_dir, cfg, args.checkpoint)
    data = RunData.from_config(cfg.data, DistEnv(0, 1, 0, 1, torch.device("cpu"), "gloo"), int(cfg.seed))
    state = fold_into_tables(load_dlrm_state(step_dir), hot_ids_of(step_dir), str(step_dir))
    trained = trained_model(cfg, data, state)
    tables = [c.name for c in trained.sparse_arch.embedding_bag_collection.embedding_bag_configs()]
    plan = parse_plan(args, tables)
    batches = list(data.batches("test", args.batch_size))
    reference = evaluate(trained, batches)
    if reference["auc"] is None:
        raise ValueError(f"the test split of {run_dir} holds one class only: AUC, hence the guard, is undefined")
    spec = serving.ServingSpec(
        model=OmegaConf.to_container(cfg.model, resolve=True),  # type: ignore[arg-type]
        dense_in_features=data.num_dense,
        dense_precision=args.dense,
        tables=tuple(
            serving.TableSpec(c.name, c.feature_names[0], c.num_embeddings, c.embedding_dim, plan[c.name])
            for c in trained.sparse_arch.embedding_bag_collection.embedding_bag_configs()
        ),
    )
    plans = PlanEvaluator(trained, spec, lambda m: evaluate(m, batches), float(reference["auc"]))
    report: dict[str, Any] = {}
    if args.search:
        plan, report["search"] = search_plan(plans, args.max_auc_drop)
        (Path(args.out) / "plan.json").parent.mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "plan.json").write_text(json.dumps(plan, indent=2) + "\n")
    rows, dense = plans.rows(plan), serving.dense_state(trained, args.dense)
    spec = plans.spec_for(plan)
    serving.save(Path(args.out), spec, rows, dense)
    got = evaluate(serving.load(args.out), batches)  # the saved files, read back: what a server runs
    table_bytes, size = serving.size_bytes(rows, dense)
    fp32_tables = sum(t.fp32_bytes() for t in spec.tables)
    fp32_size = fp32_tables + sum(v.numel() * 4 for v in serving.dense_state(trained, "fp32").values())
    report = {
        "run_dir": str(run_dir),
        "checkpoint": str(step_dir),
        **{k: got[k] for k in ("auc", "logloss", "accuracy", "samples")},
        "size_bytes": size,
        "table_bytes": table_bytes,
        **{f"fp32_{k}": reference[k] for k in ("auc", "logloss", "accuracy")},
        "fp32_size_bytes": fp32_size,
        "fp32_table_bytes": fp32_tables,
        "table_shrink": fp32_tables / table_bytes,
        "auc_drop": reference["auc"] - got["auc"],
        "dense_precision": args.dense,
        "precision": plan,
        "max_auc_drop": args.max_auc_drop,
        **report,
    }
    if args.max_auc_drop is not None:
        report["within_budget"] = report["auc_drop"] <= args.max_auc_drop
        if not report["within_budget"]:
            report["table_costs"] = costliest_tables(plans, plan)
    (Path(args.out) / "export.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dlrm-export", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="a dlrm-train run directory (holds .hydra/ and checkpoints/)")
    p.add_argument("--out", required=True, help="directory for model.json, model.pt, export.json")
    p.add_argument("--precision", choices=PRECISIONS, default="int8", help="every table's precision")
    p.add_argument("--table", action="append", default=[], metavar="TABLE=PRECISION", help="one table's precision")
    p.add_argument("--plan", help="per-table precisions from a JSON file (plan.json or export.json)")
    p.add_argument("--dense", choices=list(serving.DENSE_PRECISIONS), default="fp32", help="the MLPs' precision")
    p.add_argument("--checkpoint", help="a step-N/ directory (default: the run's newest)")
    p.add_argument("--max-auc-drop", type=float, help="fail (exit 1) when the test AUC drops more than this")
    p.add_argument("--search", action="store_true", help="choose per-table precisions within --max-auc-drop")
    p.add_argument("--batch-size", type=int, default=4096, help="evaluation batch size")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.search and args.max_auc_drop is None:
        raise SystemExit("dlrm-export: --search needs --max-auc-drop X (the AUC the search may spend)")
    if args.max_auc_drop is not None and args.max_auc_drop < 0:
        raise SystemExit(f"dlrm-export: --max-auc-drop must be >= 0 (got {args.max_auc_drop})")
    try:
        report = export(args)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"dlrm-export: {e}") from e
    print(
        f"test AUC {report['auc']:.4f} (fp32 {report['fp32_auc']:.4f}, drop {report['auc_drop']:+.4f})  "
        f"size {report['size_bytes'] / 1e6:.2f} MB (fp32 {report['fp32_size_bytes'] / 1e6:.2f} MB, "
        f"tables {report['table_shrink']:.2f}x smaller)  -> {Path(args.out) / 'export.json'}"
    )
    if report.get("within_budget") is False:
        worst = ", ".join(f"{t} ({c:+.4f})" for t, c in list(report["table_costs"].items())[:3])
        print(
            f"dlrm-export: AUC dropped {report['auc_drop']:.4f} > --max-auc-drop {args.max_auc_drop}; the tables "
            f"whose quantization cost most (AUC regained at fp32): {worst}",
            file=sys.stderr,
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
