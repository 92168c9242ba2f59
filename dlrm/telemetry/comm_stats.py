"""Statistics of every compressed dist inside a model: this rank's, all ranks', and run totals.

Sits above the sharded module (it finds the dists through
:meth:`CompressedShardedEmbeddingBagCollection.compressed_dists`); the counters themselves and
their flat ``comm/...`` keys live in the leaf module :mod:`dlrm.embedding_comm.stats`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dlrm.dense_comm.hook import DenseComm
from dlrm.embedding_comm.config import CompressionSpec
from dlrm.embedding_comm.dist import CompressedDist
from dlrm.embedding_comm.embeddingbag import CompressedShardedEmbeddingBagCollection
from dlrm.embedding_comm.sharders import qcomm_ratios
from dlrm.embedding_comm.stats import CommStats, derive, merge


def compressed_dists(model: torch.nn.Module) -> list[CompressedDist]:
    """Every compressed dist inside ``model`` (TorchRec keeps output dists in plain lists)."""
    found: list[CompressedDist] = []
    for m in model.modules():
        if isinstance(m, CompressedShardedEmbeddingBagCollection):
            found.extend(d for d in m.compressed_dists())
    return found


def input_stats(model: torch.nn.Module) -> list[CommStats]:
    """The input (KJT) all-to-all counters of every compressed sharded EBC inside ``model``."""
    return [m.input_stats for m in model.modules() if isinstance(m, CompressedShardedEmbeddingBagCollection)]


def _collect(
    model: torch.nn.Module, reset: bool, run: bool = False, dense: DenseComm | None = None
) -> tuple[dict, dict]:
    sources = [d.stats for d in compressed_dists(model)] + input_stats(model)
    sources += [dense.stats] if dense is not None else []
    state = merge(s.state(run) for s in sources)
    if reset:
        for s in sources:
            s.reset()
    return state


def _all_ranks(state: tuple[dict, dict], group: dist.ProcessGroup | None) -> tuple[dict, dict]:
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return state
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, state, group=group)
    return merge(gathered)


def run_totals(model: torch.nn.Module, dense: DenseComm | None = None) -> dict[str, float]:
    """This rank's run totals (``forward/wire_bytes``, ``dense/codec_ms``, ...; not per feature),
    without resetting anything or communicating (for probes that difference them per step)."""
    sums, _ = _collect(model, reset=False, run=True, dense=dense)
    return {k: v for k, v in sums.items() if k.count("/") == 1}


def run_sums_all_ranks(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Every run-total sum of all ranks, per-feature and sampled keys included (a collective)."""
    sums, _ = _all_ranks(_collect(model, reset=False, run=True), group)
    return sums


def comm_stats(model: torch.nn.Module, reset: bool = True, dense: DenseComm | None = None) -> dict[str, float]:
    """This rank's statistics since the last reset, as flat ``comm/...`` keys (no communication):
    the model's compressed all-to-alls, and the ``dense`` gradient hook if given."""
    return derive(*_collect(model, reset, dense=dense))


def comm_stats_all_ranks(
    model: torch.nn.Module,
    reset: bool = True,
    group: dist.ProcessGroup | None = None,
    dense: DenseComm | None = None,
) -> dict[str, float]:
    """All ranks' statistics since the last reset, merged (bytes and times summed, errors maxed).

    A collective: call it on every rank (at log or eval time, never per iteration).
    """
    return derive(*_all_ranks(_collect(model, reset, dense=dense), group))


def comm_summary(
    model: torch.nn.Module,
    spec: CompressionSpec | None = None,
    dense: DenseComm | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """Whole-run totals of all ranks for metrics.json: ``forward_ratio``, ``backward_ratio``,
    ``max_abs_error_seen`` (1.0 / 0.0 when nothing was compressed, e.g. one process), and with
    ``dense`` the option's name ``dense_comm`` and its ``dense_ratio`` (1.0 for stock DDP). A
    collective.

    TorchRec's QComms path counts no bytes; for a ``spec`` of that kind the ratios follow from its
    fixed-rate precisions instead.
    """
    d = derive(*_all_ranks(_collect(model, reset=False, run=True, dense=dense), group))
    out: dict[str, Any] = {
        "forward_ratio": d.get("comm/forward/ratio", 1.0),
        "backward_ratio": d.get("comm/backward/ratio", 1.0),
        "max_abs_error_seen": d.get("comm/max_abs_error_seen", 0.0),
    }
    if "comm/forward/cache_bytes" in d:  # compression.forward.cache: the largest rank's allocation
        out["cache_bytes_per_rank"] = d["comm/forward/cache_bytes"]
        out["cache_hit_share"] = d.get("comm/forward/cache_hit", 0.0)
        out["cache_held_share"] = d.get("comm/forward/cache_held", 0.0)
    for scheme in ("cache_probe", "cache_delta_probe"):  # compression.stats.cache_probe
        if f"comm/forward/{scheme}_hit" in d:
            out[f"{scheme}_hit_share"] = d[f"comm/forward/{scheme}_hit"]
            out[f"{scheme}_held_share"] = d[f"comm/forward/{scheme}_held"]
            out[f"{scheme}_gain"] = d.get(f"comm/forward/{scheme}_gain", 1.0)
            out[f"{scheme}_bytes_per_rank"] = d.get(f"comm/forward/{scheme}/mirror_bytes", 0.0)
            out[f"{scheme}_max_error_over_bound"] = d.get(f"comm/forward/{scheme}/max_error_over_bound", 0.0)
    if spec is not None and spec.kind == "qcomm":
        out.update(qcomm_ratios(spec))
    if dense is not None:
        out.update(dense_comm=dense.spec.name, dense_ratio=d.get("comm/dense/ratio", 1.0))
    return out


def set_iteration(model: torch.nn.Module, iteration: int) -> None:
    """Set the training iteration every compressed dist passes to the bound policies (e.g. on resume)."""
    for d in compressed_dists(model):
        d.iteration = int(iteration)
