"""TorchRec glue that routes the pooled-embedding all-to-alls (forward and backward) through the compressor.

Entry points for the trainer::

    sharders = make_sharders(cfg.compression, bound_fn_forward=None, bound_fn_backward=None)
    plan = planner.collective_plan(model, sharders, pg)
    model = DistributedModelParallel(model, device=device, plan=plan, sharders=sharders)
    ...
    stats = comm_stats(model)                # this rank, since the last call (no communication)
    stats = comm_stats_all_ranks(model)      # every rank must call it (log/eval time)
    summary = comm_summary(model)            # run totals for metrics.json (every rank calls it)

``bound_fn(feature, direction, iteration) -> float`` is the policy seam: absolute bounds with
``mode: abs``, fractions of each table block's value range with ``mode: rel``. On resume call
``set_iteration(model, iteration)`` so iteration-wise policies continue where they were.

Modules: ``config`` (the config group), ``bounds`` (policy seam), ``codec`` (one direction's
codec), ``ids`` (ids and duplicate-id gradients), ``comm_ops`` (Req/Wait autograd functions),
``dist`` (output dists), ``sharding`` (sharding subclasses), ``embeddingbag`` (sharded EBC and
sharder), ``stats`` (statistics), ``bench`` (``python -m dlrm.comm.bench``).
"""

from __future__ import annotations

from typing import Any, Mapping

from torchrec.distributed.types import ModuleSharder

from dlrm.comm.bounds import BoundFn, fixed_bound
from dlrm.comm.codec import CompressedCommError
from dlrm.comm.config import CompressionSpec, parse_compression_cfg, qcomm_ratios
from dlrm.comm.stats import comm_stats, comm_stats_all_ranks, comm_summary, set_iteration

__all__ = ["make_sharders", "build_sharders", "comm_stats", "comm_stats_all_ranks", "comm_summary", "set_iteration",
           "parse_compression_cfg", "qcomm_ratios", "fixed_bound", "BoundFn", "CompressedCommError"]


def _qcomm_registry(spec: CompressionSpec) -> dict[str, Any] | None:
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry

    cfg = QCommsConfig(forward_precision=CommType(spec.qcomm_forward),
                       backward_precision=CommType(spec.qcomm_backward))
    # No device argument, as in TorchRec's examples: with device="cpu" TorchRec silently turns
    # bf16 into fp16, although bf16 runs on gloo with torch 2.13.
    return get_qcomm_codecs_registry(cfg)


def build_sharders(spec: CompressionSpec, bound_fn_forward: BoundFn | None = None,
                   bound_fn_backward: BoundFn | None = None,
                   fused_params: dict[str, Any] | None = None) -> list[ModuleSharder]:
    """The EBC sharder for a parsed :class:`CompressionSpec`."""
    from dlrm.comm.codec import DirectionCodec
    from dlrm.comm.dist import CompressionRuntime
    from dlrm.comm.embeddingbag import (CompressedEmbeddingBagCollectionSharder,
                                        StockEmbeddingBagCollectionSharder)

    if spec.kind == "qcomm":
        if bound_fn_forward is not None or bound_fn_backward is not None:
            raise ValueError(f"compression {spec.name!r} is a QComms config: it has no error bounds")
        return [StockEmbeddingBagCollectionSharder(fused_params=fused_params,
                                                   qcomm_codecs_registry=_qcomm_registry(spec),
                                                   sharding_types=spec.sharding_types)]
    assert spec.forward is not None and spec.backward is not None
    runtime = CompressionRuntime(forward=DirectionCodec(spec.forward, "forward", bound_fn_forward),
                                 backward=DirectionCodec(spec.backward, "backward", bound_fn_backward),
                                 sample_every=spec.sample_every, name=spec.name)
    return [CompressedEmbeddingBagCollectionSharder(runtime, fused_params=fused_params,
                                                    sharding_types=spec.sharding_types)]


def make_sharders(compression_cfg: Mapping[str, Any], bound_fn_forward: BoundFn | None = None,
                  bound_fn_backward: BoundFn | None = None, *,
                  fused_params: dict[str, Any] | None = None) -> list[ModuleSharder]:
    """Sharders for a `compression` config (dict or DictConfig); pass them to the planner and DMP.

    ``bound_fn_*(feature, direction, iteration) -> float`` override the config's fixed ``eb``
    (absolute, or a fraction of each block's range with ``mode: rel``).
    """
    return build_sharders(parse_compression_cfg(compression_cfg), bound_fn_forward, bound_fn_backward,
                          fused_params)
