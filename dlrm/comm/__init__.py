"""TorchRec glue that routes the pooled-embedding all-to-alls (forward and backward) through the compressor.

Entry points for the trainer::

    sharders = make_sharders(cfg.compression, bound_fn_forward=policy, bound_fn_backward=policy)
    plan = planner.collective_plan(model, sharders, pg)
    model = DistributedModelParallel(model, device=device, plan=plan, sharders=sharders)
    ...
    stats = comm_stats(model)                # this rank, since the last call (no communication)
    stats = comm_stats_all_ranks(model)      # every rank must call it (log/eval time)
    summary = comm_summary(model)            # run totals for metrics.json (every rank calls it)

``bound_fn(feature, direction, iteration) -> float`` is the policy seam: absolute bounds with
``mode: abs``, fractions of each table block's value range with ``mode: rel``. On resume call
``set_iteration(model, iteration)`` so iteration-wise policies continue where they were.

Modules, leaves first: ``config`` (the config group), ``stats`` (counters and their keys),
``instrument`` (marks the embedding collectives for probes), ``bounds`` (policy seam), ``codec``
(one direction's codec), ``ids`` (ids and duplicate-id gradients), ``comm_ops`` (Req/Wait autograd
functions), ``dist`` (output dists), ``sharding`` (sharding subclasses), ``embeddingbag`` (sharded
EBC and sharders), ``sharders`` (config -> sharder), ``collect`` (statistics of a whole model).
"""

from dlrm.comm.bounds import BoundFn, fixed_bound
from dlrm.comm.codec import CompressedCommError
from dlrm.comm.collect import comm_stats, comm_stats_all_ranks, comm_summary, compressed_dists, set_iteration
from dlrm.comm.config import CompressionSpec, parse_compression_cfg, qcomm_ratios
from dlrm.comm.sharders import build_sharders, compression_runtime, make_sharders

__all__ = [
    "BoundFn",
    "CompressedCommError",
    "CompressionSpec",
    "build_sharders",
    "comm_stats",
    "comm_stats_all_ranks",
    "comm_summary",
    "compressed_dists",
    "compression_runtime",
    "fixed_bound",
    "make_sharders",
    "parse_compression_cfg",
    "qcomm_ratios",
    "set_iteration",
]
