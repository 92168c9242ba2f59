"""Whole training runs on the device backends (``compression.backend=device``,
``dense_comm.backend=device``: the code a GPU runs, on CPU tensors) keep issue 25's budget: one
host synchronisation per side of each compressed all-to-all (three for a send that samples), and
per collective of a hot-row sync, three per DCT bucket (one per phase of its default reduce-scatter,
and its received payloads' checks; two for an all-gather);
none per chunk or table
(dlrm.bench.sync_budget: 2 gloo ranks, the trainer, the bundled Criteo rows). Each configuration
was seen over budget before its device path landed; the bench runs all of them
(``python -m dlrm.bench.sync_budget``), this suite the ones whose code paths differ most (the row
cache included: it picks on the device between its payload and the codec's, so which chunks hold
ids is read with the sizes)."""

import pytest

from dlrm.bench import sync_budget

SIDES = {"a2a/forward/send", "a2a/forward/receive", "a2a/backward/send", "a2a/backward/receive"}


@pytest.mark.parametrize(
    "name, labels",
    [
        ("lossy", SIDES),  # row-wise on this model: partial sums deduplicated by value
        ("auto_mixed", SIDES | {"dct/bucket"}),  # every option of auto, DCT on the dense gradients
        ("dct_mp", SIDES),
        ("row_cache", SIDES),
        ("hot_coded", SIDES | {"hot/sync"}),
        ("lossy+ids", SIDES),  # table-wise dedup by id with the coded input's plans
    ],
)
def test_training_on_the_device_backends_keeps_the_sync_budget(name, labels, tmp_path):
    assert sync_budget.DEVICE == ["compression.backend=device", "dense_comm.backend=device"]  # every run's
    m = sync_budget.measure(name, sync_budget.overrides_of(name, tmp_path), 2, 14, 4, tmp_path / name)
    rows = {r["label"]: r for r in sync_budget.rows(name, m) if r["label"] != "other"}
    assert labels <= set(rows), (labels, sorted(rows))  # every site ran in the counted iterations
    assert any(label.endswith(" sampled") for label in rows)  # and a sampling send (iteration 10)
    over = {k: (r["median"], r["worst"], r["budget"]) for k, r in rows.items() if not r["within"]}
    assert not over, over
