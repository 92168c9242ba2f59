"""What a short 2-rank run tells its user: an undefined test AUC is null (with a warning naming the
split and its class counts), and no third-party warning clutters the output while ours still shows.

One real run serves both tests: real Criteo rows through dlrm-preprocess, with a test split of
negative rows only, trained by torchrun with every Python warning shown (PYTHONWARNINGS=default).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from run_artifacts import events
from trainer_runs import REPO, SMALL, env_for, torchrun_cmd

from data.preprocess import SAMPLE_DIR, preprocess

NEGATIVES = 300
OUR_WARNING = f"test AUC is undefined: the split has 0 positive and {NEGATIVES} negative rows"
# What the libraries printed on every such run before dlrm/process/quiet.py (see its NOISE lists)
THIRD_PARTY = re.compile(
    r"(Warning: |is_fx_tracing|Sharding spec not found|caching params will be ignored|"
    r"site-packages/(torch|torchrec|fbgemm_gpu|torchmetrics)/)"
)


@pytest.fixture(scope="module")
def one_class_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("one_class")
    raw = tmp / "raw"
    raw.mkdir()
    (raw / "train.tsv").write_text("".join((SAMPLE_DIR / "train.tsv").read_text().splitlines(keepends=True)[:1500]))
    (raw / "dev.tsv").write_text((SAMPLE_DIR / "dev.tsv").read_text())  # both classes
    test_rows = (SAMPLE_DIR / "test.tsv").read_text().splitlines(keepends=True)
    (raw / "test.tsv").write_text("".join([r for r in test_rows if r.startswith("0\t")][:NEGATIVES]))
    preprocess([raw / f"{s}.tsv" for s in ("train", "dev", "test")], tmp / "data")
    run_dir = tmp / "run"
    overrides = ["data=criteo", f"data.processed_dir={tmp / 'data'}", "max_iterations=8", "eval_every=4"]
    cmd = torchrun_cmd(2, [f"hydra.run.dir={run_dir}", *SMALL, *overrides])
    env = dict(env_for(tmp / "cache"), PYTHONWARNINGS="default")  # deprecations too, as pytest shows them
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return run_dir, proc


def test_an_undefined_test_auc_is_null_with_a_warning_and_absent_from_tensorboard(one_class_run):
    run_dir, proc = one_class_run
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["auc"] is None and '"auc": null' in (run_dir / "metrics.json").read_text()
    assert metrics["samples"] == NEGATIVES and metrics["accuracy"] > 0 and metrics["logloss"] > 0
    assert 0.0 < metrics["val_auc"] < 1.0  # the validation split has both classes
    output = proc.stdout + proc.stderr
    assert output.count(OUR_WARNING) == 1  # once, from rank 0
    assert "test AUC n/a" in proc.stdout
    tags = set(events(run_dir).Tags()["scalars"])
    assert {"test/logloss", "test/accuracy", "eval/auc", "hparam/logloss", "hparam/forward_ratio"} <= tags
    assert "test/auc" not in tags and "hparam/auc" not in tags


def test_a_run_prints_no_third_party_warnings_but_still_ours(one_class_run):
    _, proc = one_class_run
    noise = [line for line in (proc.stderr + proc.stdout).splitlines() if THIRD_PARTY.search(line)]
    assert noise == []
    assert OUR_WARNING in proc.stdout  # Hydra's console log of the dlrm loggers
