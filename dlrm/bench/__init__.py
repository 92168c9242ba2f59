"""Benchmarks and reports around the trainer (not part of it; the trainer never imports this package).

* :mod:`dlrm.bench.netbench` - end-to-end speedup on an emulated link (network namespace + ``tc``),
  with :mod:`dlrm.bench.netprobe` (per-iteration timings inside each rank) and
  :mod:`dlrm.bench.netreport` (tables, cost-model check, projection);
* :mod:`dlrm.bench.comm` - micro-benchmark of the compressed embedding all-to-alls alone;
* :mod:`dlrm.bench.summary` - the command line of :mod:`dlrm.telemetry.sweep_summary` (accuracy
  against compression ratio over a sweep: table + Pareto plot);
* :mod:`dlrm.bench.accuracy` - converged accuracy: an lr sweep of ``none``, then every configuration
  x seed to the same early-stopping rule, reported as AUC against bytes per iteration;
* :mod:`dlrm.bench.dense_state` - what the MLP optimizer did under ``dense_comm`` (from checkpoints).
"""
