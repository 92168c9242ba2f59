"""`dlrm-export` on a real trained run: quantized serving models (int8, int4, per table), their
accuracy and size against the fp32 model, the AUC guard and search, and loading in a fresh process."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_runs import REPO, env_for, train

from dlrm.precision.export import main

DIM = 64  # int8 rows of 64 values + 4 bytes of scale and bias: 3.76x under fp32; int4: 7.1x
# One epoch of the bundled Criteo rows; compression=none so that the trainer's own test pass
# and the exported fp32 model see the same numbers. On this run int4 tables cost 0.0009 test AUC
# (391 rows); on most seeds and sparse learning rates quantization moves the AUC of so small a
# split by under 0.001 either way, which would leave the zero-budget guard nothing to catch.
TRAIN = [
    f"model.embedding_dim={DIM}",
    f"model.dense_arch_layer_sizes=[32,{DIM}]",
    "compression=none",
    "optimizer.sparse.lr=0.2",
    "seed=1",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("export")
    cache, run_dir = root / "cache", root / "run"
    train(run_dir, cache, TRAIN)
    return run_dir, cache


def export(run_dir: Path, out: Path, *args: str, check: bool = True) -> tuple[int, str]:
    """``dlrm-export RUN_DIR --out OUT ARGS`` in this process (a subprocess would import torch and
    TorchRec again each time): its exit status and stderr."""
    err, code = io.StringIO(), 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main([str(run_dir), "--out", str(out), *args])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
            print(e.code, file=err)
    if check and code != 0:
        raise AssertionError(f"dlrm-export failed ({code}):\n{err.getvalue()[-3000:]}")
    return code, err.getvalue()


def table_rows(cache: Path) -> list[int]:
    """Rows per table, from the preprocessed sample's own meta.json."""
    (meta,) = cache.glob("criteo_sample-*/meta.json")
    return [int(n) for n in json.loads(meta.read_text())["num_embeddings"]]


@pytest.mark.parametrize("precision, row_bytes, shrink", [("int8", DIM + 4, 3.5), ("int4", DIM // 2 + 4, 6.0)])
def test_quantized_export_keeps_the_auc_and_shrinks_the_tables(run, tmp_path, precision, row_bytes, shrink):
    run_dir, cache = run
    export(run_dir, tmp_path, "--precision", precision)
    got = json.loads((tmp_path / "export.json").read_text())
    trained = json.loads((run_dir / "metrics.json").read_text())
    # the fp32 model rebuilt from the sharded checkpoint is the trained one: the trainer's own test AUC
    assert got["fp32_auc"] == pytest.approx(trained["auc"], abs=1e-6)
    assert got["samples"] == trained["samples"]
    rows = table_rows(cache)
    assert got["fp32_table_bytes"] == sum(rows) * DIM * 4
    assert got["table_bytes"] == sum(rows) * row_bytes  # FBGEMM's row-wise layout: values + fp16 scale, bias
    assert got["fp32_table_bytes"] / got["table_bytes"] >= shrink
    assert got["size_bytes"] < got["fp32_size_bytes"] and set(got["precision"].values()) == {precision}
    if precision == "int8":
        assert abs(got["auc"] - got["fp32_auc"]) <= 0.002, got
    assert got["logloss"] != got["fp32_logloss"]  # the served tables are not the trained ones


def test_guard_fails_on_a_zero_budget_naming_tables_and_passes_on_a_generous_one(run, tmp_path):
    run_dir, cache = run
    # the command as a user runs it: the exit status is the gate
    cmd = [sys.executable, "-m", "dlrm.precision.export", str(run_dir), "--out", str(tmp_path / "strict")]
    cmd += ["--precision", "int4", "--max-auc-drop", "0"]
    proc = subprocess.run(cmd, cwd=REPO, env=env_for(cache), capture_output=True, text=True, timeout=300)
    report = json.loads((tmp_path / "strict" / "export.json").read_text())
    assert report["auc_drop"] > 0, "int4 cost no AUC at all on this run: the zero budget tests nothing"
    assert proc.returncode == 1 and report["within_budget"] is False, proc.stderr[-3000:]
    costliest = list(report["table_costs"])[:3]
    assert len(costliest) == 3 and all(t in proc.stderr for t in costliest)
    assert (tmp_path / "strict" / "model.pt").exists()  # the model is kept for inspection
    code, _ = export(run_dir, tmp_path / "loose", "--precision", "int4", "--max-auc-drop", "0.5")
    assert code == 0 and json.loads((tmp_path / "loose" / "export.json").read_text())["within_budget"]


def test_search_plan_stays_within_budget_and_reexports_to_the_same_model(run, tmp_path):
    run_dir, _ = run
    budget = 0.001
    export(run_dir, tmp_path / "search", "--search", "--max-auc-drop", str(budget))
    report = json.loads((tmp_path / "search" / "export.json").read_text())
    plan = json.loads((tmp_path / "search" / "plan.json").read_text())
    assert report["auc_drop"] <= budget and report["precision"] == plan
    assert len(plan) == 26 and set(plan.values()) <= {"int4", "int8", "fp16", "fp32"}
    assert any(p != "fp32" for p in plan.values())
    # each pass tried its tables in order of the AUC they lose alone, and stopped at its first miss
    for precision in ("int4", "int8", "fp16"):
        tried = [s for s in report["search"] if s["precision"] == precision]
        assert [s["drop_alone"] for s in tried] == sorted(s["drop_alone"] for s in tried)
        assert all(s["kept"] for s in tried[:-1])
        assert all(plan[s["table"]] == precision for s in tried if s["kept"])
    export(run_dir, tmp_path / "again", "--plan", str(tmp_path / "search" / "plan.json"))
    again = json.loads((tmp_path / "again" / "export.json").read_text())
    assert again["auc"] == report["auc"] and again["size_bytes"] == report["size_bytes"]


FRESH = """
import json, sys
from pathlib import Path
import torch
from torchmetrics.functional.classification import binary_auroc
from data.loader import criteo_batches
from dlrm.precision.serving import load

out, data = Path(sys.argv[1]), Path(sys.argv[2])
model = load(out)
assert not torch.distributed.is_initialized()
held = [m for m in sys.modules if m == "dlrm.train" or m.startswith(("dlrm.embedding_comm", "dlrm.trainer.sharding"))]
assert not held, held
probs, labels = [], []
with torch.no_grad():
    for batch in criteo_batches(data, ["test"], 1000, 0, 1, shuffle=False, seed=0):
        probs.append(torch.sigmoid(model(batch.dense_features, batch.sparse_features)))
        labels.append(batch.labels)
print(json.dumps({"auc": float(binary_auroc(torch.cat(probs), torch.cat(labels).long())), "n": len(torch.cat(probs))}))
"""


def test_export_loads_and_predicts_in_a_fresh_process(run, tmp_path):
    run_dir, cache = run
    export(run_dir, tmp_path, "--precision", "int8", "--table", "t_cat_2=int4", "--dense", "bf16")
    report = json.loads((tmp_path / "export.json").read_text())
    spec = json.loads((tmp_path / "model.json").read_text())
    assert {t["name"]: t["precision"] for t in spec["tables"]}["t_cat_2"] == "int4"
    assert report["precision"]["t_cat_3"] == "int8" and spec["dense_precision"] == "bf16"
    (data,) = cache.glob("criteo_sample-*")
    proc = subprocess.run(
        [sys.executable, "-c", FRESH, str(tmp_path), str(data)],
        cwd=REPO,
        env=env_for(cache),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    fresh = json.loads(proc.stdout.strip().splitlines()[-1])
    assert fresh["n"] == report["samples"]
    assert fresh["auc"] == pytest.approx(report["auc"], abs=1e-6)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--table", "t_cat_99=int8"], "no table named ['t_cat_99']"),
        (["--table", "t_cat_0=int3"], "table t_cat_0 has precision 'int3'"),
        (["--search"], "--search needs --max-auc-drop"),
    ],
)
def test_bad_export_arguments_name_the_table_or_flag(run, tmp_path, args, message):
    run_dir, _ = run
    code, stderr = export(run_dir, tmp_path, *args, check=False)
    assert code != 0 and message in stderr


def test_export_of_a_directory_without_a_run_names_the_missing_file(tmp_path):
    code, stderr = export(tmp_path, tmp_path / "out", check=False)
    assert code != 0 and f"{tmp_path / '.hydra' / 'config.yaml'} is missing" in stderr


@pytest.mark.parametrize("sharding", ["row_wise", "column_wise"])
def test_export_rebuilds_whole_tables_from_every_sharding(tmp_path, sharding):
    # the run fixture is table-wise (the planner's choice there); these split every table
    run_dir = tmp_path / "run"
    train(run_dir, tmp_path / "cache", [*TRAIN, f"sharding={sharding}", "max_iterations=4"])
    trained = json.loads((run_dir / "metrics.json").read_text())
    assert {p.split()[0] for p in trained["sharding_plan"].values()} == {sharding}
    export(run_dir, tmp_path / "out", "--precision", "fp32")
    got = json.loads((tmp_path / "out" / "export.json").read_text())
    assert got["fp32_auc"] == pytest.approx(trained["auc"], abs=1e-6) and got["auc"] == got["fp32_auc"]


def test_export_reads_checkpoint_dir_from_the_run_and_skips_a_damaged_newest_step(tmp_path):
    run_dir, ckpts = tmp_path / "run", tmp_path / "run" / "elsewhere"
    saved = ["checkpoint.dir=${hydra:runtime.output_dir}/elsewhere", "checkpoint.every=2", "max_iterations=4"]
    train(run_dir, tmp_path / "cache", [*TRAIN, *saved])
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-2", "step-4"]
    assert not (run_dir / "checkpoints").exists()
    export(run_dir, tmp_path / "out", "--precision", "fp32")
    assert json.loads((tmp_path / "out" / "export.json").read_text())["checkpoint"] == str(ckpts / "step-4")

    shard = sorted((ckpts / "step-4").glob("*.distcp"))[0]  # a model shard, one byte flipped
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    code, stderr = export(run_dir, tmp_path / "out2", "--precision", "fp32")
    assert f"{shard} has" in stderr  # named, and passed over for the previous intact step
    assert json.loads((tmp_path / "out2" / "export.json").read_text())["checkpoint"] == str(ckpts / "step-2")
    (ckpts / "step-2" / ".metadata").write_text("{")  # no intact step left: refused, naming it
    code, stderr = export(run_dir, tmp_path / "out3", "--precision", "fp32", check=False)
    assert code != 0 and f"{ckpts / 'step-2' / '.metadata'} is unreadable" in stderr, stderr
