"""The performance model: what an iteration costs on a network, and the search that uses it.

``network`` (links, the bytes each collective sends, their seconds on one or two levels),
``cost_model`` (the workload, codec costs, the one :func:`~dlrm.performance.cost_model.iteration_time`
and its :class:`~dlrm.performance.cost_model.Breakdown`, the published projections), ``search``
(``auto``'s timeline of one iteration and Espresso's greedy choice over it) are pure arithmetic;
``link_timing`` times the links of a running job (a collective).
"""
