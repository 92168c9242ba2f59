"""The EBC sharder for a `compression` config: ours (compressed dists) or TorchRec's own (QComms)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torchrec.distributed.fbgemm_qcomm_codec import (
    CommType,
    QCommsConfig,
    get_qcomm_codecs,
    get_qcomm_codecs_registry,
)
from torchrec.distributed.types import ModuleSharder

from dlrm.embedding_comm.bounds import BoundFn
from dlrm.embedding_comm.cache_probe import CacheProbe
from dlrm.embedding_comm.codec import DirectionCodec
from dlrm.embedding_comm.config import CompressionSpec, parse_compression_cfg
from dlrm.embedding_comm.dist import CompressionRuntime
from dlrm.embedding_comm.embeddingbag import CompressedEmbeddingBagCollectionSharder, StockEmbeddingBagCollectionSharder
from dlrm.embedding_comm.forward_cache import ForwardCache
from dlrm.embedding_comm.input_switch import InputSwitch
from dlrm_compression.ids_codec import IdsCodec


def qcomms_config(spec: CompressionSpec) -> QCommsConfig:
    """TorchRec's QCommsConfig for a ``kind: qcomm`` spec (precisions, MX4's group sizes)."""
    return QCommsConfig(
        forward_precision=CommType(spec.qcomm_forward),
        backward_precision=CommType(spec.qcomm_backward),
        mx4_quantize_dim=spec.qcomm_mx4_dim,
        mx4_quantize_dim_bwd=spec.qcomm_mx4_dim_bwd,
    )


def _qcomm_registry(spec: CompressionSpec) -> dict[str, Any] | None:
    cfg = qcomms_config(spec)
    # No device argument, as in TorchRec's examples: with device="cpu" TorchRec silently turns
    # bf16 into fp16, although bf16 runs on gloo with torch 2.13.
    return get_qcomm_codecs_registry(cfg)


def qcomm_ratios(spec: CompressionSpec, width: int = 128) -> dict[str, float]:
    """``forward_ratio``/``backward_ratio`` of a QComms config, measured: fp32 bytes over the bytes
    TorchRec's own codec makes of rows ``width`` wide (the stock path has no byte counters, but its
    codecs are fixed-rate, so one encoding measures every payload)."""
    codecs = get_qcomm_codecs(qcomms_config(spec))
    rows = torch.rand(32, width, generator=torch.Generator().manual_seed(0)) - 0.5
    out = {}
    for direction, codec in (("forward", codecs.forward), ("backward", codecs.backward)):
        payload = codec.encode(rows, codec.create_context()) if codec is not None else rows  # MX4: uint8 groups
        out[f"{direction}_ratio"] = rows.numel() * rows.element_size() / (payload.numel() * payload.element_size())
    return out


def build_sharders(
    spec: CompressionSpec,
    bound_fn_forward: BoundFn | None = None,
    bound_fn_backward: BoundFn | None = None,
    fused_params: dict[str, Any] | None = None,
) -> list[ModuleSharder]:
    """The EBC sharder for a parsed :class:`CompressionSpec`; bounded codecs need their direction's
    ``bound_fn`` (a policy, or :func:`dlrm.embedding_comm.fixed_bound`)."""
    if spec.kind == "qcomm":
        if bound_fn_forward is not None or bound_fn_backward is not None:
            raise ValueError(f"compression {spec.name!r} is a QComms config: it has no error bounds")
        return [
            StockEmbeddingBagCollectionSharder(
                fused_params=fused_params,
                qcomm_codecs_registry=_qcomm_registry(spec),
                sharding_types=spec.sharding_types,
            )
        ]
    assert spec.forward is not None and spec.backward is not None
    forward = DirectionCodec(spec.forward, "forward", bound_fn_forward, spec.backend)
    backward = DirectionCodec(spec.backward, "backward", bound_fn_backward, spec.backend)
    if backward.forward_positions and forward.keep is None:
        raise ValueError(
            "compression.backward.params.forward_positions sends gradients where the forward's threshold codec "
            f"kept entries, but compression.forward.codec is {spec.forward.codec!r} (use codec: threshold, keep: ...)"
        )
    if spec.cache_probe_rows is not None and not (forward.bounded and forward.dedup):
        raise ValueError(
            "compression.stats.cache_probe measures the error-bounded forward path by id: it needs "
            f"compression.forward.codec lossy (got {spec.forward.codec!r}) and compression.forward.dedup: true"
        )
    if spec.cache_probe_rows is not None and spec.forward.cache_rows is not None:
        raise ValueError(
            "compression.stats.cache_probe measures the cache-free forward path: disable it or "
            "compression.forward.cache (which reports its own ratio)"
        )
    probe = None if spec.cache_probe_rows is None else CacheProbe(spec.cache_probe_rows, backend=spec.backend)
    cache = None if spec.forward.cache_rows is None else ForwardCache(spec.forward.cache_rows, backend=spec.backend)
    runtime = CompressionRuntime(
        forward=forward,
        backward=backward,
        sample_every=spec.sample_every,
        name=spec.name,
        cache_probe=probe,
        forward_cache=cache,
        input_codec=IdsCodec(backend=spec.backend) if spec.input in ("ids", "auto") else None,
        input_switch=InputSwitch() if spec.input == "auto" else None,
    )
    return [
        CompressedEmbeddingBagCollectionSharder(runtime, fused_params=fused_params, sharding_types=spec.sharding_types)
    ]


def make_sharders(
    compression_cfg: Mapping[str, Any],
    bound_fn_forward: BoundFn | None = None,
    bound_fn_backward: BoundFn | None = None,
    *,
    fused_params: dict[str, Any] | None = None,
) -> list[ModuleSharder]:
    """Sharders for a `compression` config (dict or DictConfig); pass them to the planner and DMP.

    ``bound_fn_*(feature, direction, iteration) -> float``: the bound of each table block (absolute,
    or a fraction of each block's range with ``mode: rel``).
    """
    return build_sharders(parse_compression_cfg(compression_cfg), bound_fn_forward, bound_fn_backward, fused_params)


def compression_runtime(sharders: Sequence[ModuleSharder]) -> CompressionRuntime | None:
    """The codecs' runtime behind our sharder (its per-rank state is checkpointed); None for QComms."""
    for sharder in sharders:
        if isinstance(sharder, CompressedEmbeddingBagCollectionSharder):
            return sharder.runtime
    return None
