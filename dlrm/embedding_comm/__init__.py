"""TorchRec glue that routes the pooled-embedding all-to-alls (forward and backward) through the compressor.

Entry points for the trainer::

    sharders = make_sharders(cfg.compression, bound_fn_forward=policy, bound_fn_backward=policy)
    plan = planner.collective_plan(model, sharders, pg)
    model = DistributedModelParallel(model, device=device, plan=plan, sharders=sharders)

Statistics of a whole model (``comm_stats``, ``comm_summary``) live in :mod:`dlrm.telemetry.comm_stats`.

``bound_fn(feature, direction, iteration) -> float`` is the policy seam: absolute bounds with
``mode: abs``, fractions of each table block's value range with ``mode: rel``. On resume call
``dlrm.telemetry.comm_stats.set_iteration(model, iteration)`` so iteration-wise policies continue where they were.

Modules, leaves first: ``config`` (the config group), ``stats`` (counters and their keys),
``bounds`` (policy seam), ``codec`` (one direction's codec), ``ids`` (ids and duplicate-id
gradients), ``stage`` (the one interface through which features act on the transport's chunks)
and its stages: ``codec_stages`` (duplicate ids, DCT-MP positions, calibration), ``forward_cache``
(the row cache), ``cache_probe``; ``comm_ops`` (Req/Wait autograd functions), ``dist`` (output
dists), ``sharding`` (sharding subclasses), ``embeddingbag`` (sharded EBC and sharders),
``sharders`` (config -> sharder), ``policy`` (the ``policy`` group -> bound policy).
"""

from dlrm.embedding_comm.bounds import BoundFn, fixed_bound
from dlrm.embedding_comm.codec import CompressedCommError
from dlrm.embedding_comm.config import CompressionSpec, parse_compression_cfg
from dlrm.embedding_comm.sharders import build_sharders, compression_runtime, make_sharders, qcomm_ratios

__all__ = [
    "BoundFn",
    "CompressedCommError",
    "CompressionSpec",
    "build_sharders",
    "compression_runtime",
    "fixed_bound",
    "make_sharders",
    "parse_compression_cfg",
    "qcomm_ratios",
]
