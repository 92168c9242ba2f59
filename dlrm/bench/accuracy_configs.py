"""What the converged-accuracy benchmark (:mod:`dlrm.bench.accuracy`) trains: each configuration's
Hydra overrides, the data and model of each ``--data``, and the stopping rule every run shares."""

from __future__ import annotations

# The configurations: the baseline, TorchRec's QComms, ours with each dense option, the
# automatic strategy, hot-row replication with the coded sync, the row cache, low precision.
CONFIGS: dict[str, tuple[str, ...]] = {
    "none": ("compression=none",),
    "qcomm_fp16": ("compression=qcomm_fp16",),
    "qcomm_mx4": ("compression=qcomm_mx4",),
    "lossy": ("compression=lossy",),
    "lossy+dct": ("compression=lossy", "dense_comm=dct"),
    "lossy+powersgd": ("compression=lossy", "dense_comm=powersgd"),
    "auto+auto": ("compression=auto", "dense_comm=auto"),
    "lossy+hot_rows": ("compression=lossy", "placement.hot_rows=auto", "placement.sync_codec=backward"),
    "lossy+row_cache": ("compression=lossy", "compression.forward.cache.enabled=true"),
    "lossy+mixed": ("compression=lossy", "precision=mixed"),
    # not in the default list: DCT's all-gather aggregation, its default before issue 38 (bytes per
    # rank that grow with the ranks; dense_comm=dct now sums by reduce-scatter)
    "lossy+dct_ag": ("compression=lossy", "dense_comm=dct", "dense_comm.aggregation=allgather"),
}
# Where `lossy`'s AUC goes (issue 38): `lossy` with one part of its compression left exact. A bound
# of 0 sends a table exactly (as raw values, twice their bytes: these rows' bytes mean nothing).
_FORWARD_EXACT = (
    "compression.forward.codec=none",
    "compression.forward.dedup=false",
    "compression.forward.params=null",
)
_BWD_CLASSES = ("policy.backward.kind=table_wise", "policy.backward.eb=null", "+policy.backward.classes.source=auto")


def _window(start: int, end: int | None) -> tuple[str, ...]:
    window = f"{{start: {start}, end: {'null' if end is None else end}}}"
    return tuple(f"+policy.{d}.window={window}" for d in ("forward", "backward"))


DIAGNOSTICS: dict[str, tuple[str, ...]] = {
    "lossy_fwd": ("compression=lossy_forward",),  # forward only: gradients exact
    "lossy_bwd": ("compression=lossy", *_FORWARD_EXACT),  # backward only: embeddings exact
    # the 8 largest tables (the dual policy's tight class) compressed, the 18 others exact; and back
    "lossy_large": (
        "compression=lossy",
        "policy.forward.bounds.base=0",
        "policy.forward.bounds.loose=0",
        *_BWD_CLASSES,
        "+policy.backward.bounds={tight: 0.01, base: 0, loose: 0}",
    ),
    "lossy_small": (
        "compression=lossy",
        "policy.forward.bounds.tight=0",
        *_BWD_CLASSES,
        "+policy.backward.bounds={tight: 0, base: 0.01, loose: 0.01}",
    ),
    # training compressed on the first or the second half of the first epoch only (the best
    # step of every run so far is the epoch's end, 240), evaluation forwards exact; and all of
    # training compressed, evaluation forwards exact
    "lossy_first": ("compression=lossy", *_window(0, 120), "+policy.forward.evaluation=exact"),
    "lossy_second": ("compression=lossy", *_window(120, None), "+policy.forward.evaluation=exact"),
    "lossy_eval_exact": ("compression=lossy", "+policy.forward.evaluation=exact"),
}
CONFIGS.update(DIAGNOSTICS)
# The mechanisms tried to close the gap (docs/results.md, "Where lossy's AUC goes")
_plateau_dual = tuple(
    f"+policy.{d}.plateau={{factor: 0.5, min_delta: 0.001, patience: 1, floor: 0.125}}" for d in ("forward", "backward")
)
CONFIGS.update(
    {
        "lossy+plateau": ("compression=lossy", "policy=plateau"),
        "lossy+dct+plateau": ("compression=lossy", "dense_comm=dct", "policy=plateau"),
        "lossy+row_cache+plateau": ("compression=lossy", "compression.forward.cache.enabled=true", "policy=plateau"),
        # the first plateau tried: the dual policy (2x early) times the level, both directions, min_delta 0.001
        "lossy+plateau_dual": ("compression=lossy", "policy=dual", *_plateau_dual),
    }
)
DEFAULT_CONFIGS = (
    "none",
    "qcomm_fp16",
    "qcomm_mx4",
    "lossy",
    "lossy+dct",
    "lossy+powersgd",
    "auto+auto",
    "lossy+hot_rows",
    "lossy+row_cache",
    "lossy+mixed",
)
# Synthetic Criteo-like rows with the Terabyte MLPs (762,177 dense parameters), 2,048 rows per rank,
# a validation pass every 30 iterations (~1/8 epoch at 1M rows); or the bundled real sample at the
# default model, a pass every 10 of its 57 iterations per epoch.
DATA: dict[str, tuple[str, ...]] = {
    "synthetic": (
        "data=synthetic",
        "data.rows.dev=50000",
        "data.rows.test=100000",
        "model.embedding_dim=64",
        "model.dense_arch_layer_sizes=[512,256,64]",
        "model.over_arch_layer_sizes=[512,512,256,1]",
        "batch_size=2048",
        "eval_batch_size=8192",
        "sharding=table_wise",
        "eval_every=30",
        "epochs=4",
    ),
    "sample": ("data=criteo_sample", "eval_every=10", "epochs=20"),
}
COMMON = ("progress_bar=false", "checkpoint.keep=1", "early_stopping.patience=3")
