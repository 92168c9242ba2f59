"""DCT-DP, the ``dense_comm=dct`` hook (Gupta et al., KDD'21): :mod:`.state` holds what a rank keeps
(residuals, thresholds, their schedule), :mod:`.payload` how a selection is coded and sized,
:mod:`.aggregation` how the payloads are summed (all-gather or reduce-scatter), :mod:`.hook` the
hook of one bucket."""
