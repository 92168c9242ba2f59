"""data/frequency.py: the id-frequency summary and its expected-distinct model, against draws."""

import numpy as np
import pytest

from data.frequency import FeatureFrequency, fit_zipf, frequency_meta, read_frequency


def _zipf(n: int, s: float) -> np.ndarray:
    p = np.arange(1, n + 1, dtype=np.float64) ** -s
    return p / p.sum()


@pytest.mark.parametrize("s", [0.8, 1.1, 1.4])
def test_fitted_exponent_recovers_the_generating_one(s):
    counts = np.round(1e7 * _zipf(20000, s))
    assert fit_zipf(counts[counts > 0]) == pytest.approx(s, abs=0.05)


def test_flat_counts_fit_no_power_law():
    assert fit_zipf(np.full(100, 7)) == 0.0


@pytest.mark.parametrize(("s", "top_n"), [(1.05, 64), (1.3, 1024), (0.6, 16)])
def test_expected_distinct_matches_simulated_batches(s, top_n):
    """The model (top ids counted, tail as a fitted power law) against distinct counts of real draws."""
    rng = np.random.default_rng(1)
    n = 40000
    p = _zipf(n, s)
    ids = rng.permutation(n)  # hot ids are not the small ones
    sample = ids[rng.choice(n, size=3_000_000, p=p)]
    freq = FeatureFrequency.from_ids(sample, top_n)
    for batch in (128, 1024, 8192):
        measured = np.mean([len(np.unique(ids[rng.choice(n, size=batch, p=p)])) for _ in range(30)])
        assert freq.expected_distinct(batch) == pytest.approx(measured, rel=0.05)
        hot = set(freq.top_ids[:10].tolist())
        cold = np.mean([len(set(np.unique(ids[rng.choice(n, size=batch, p=p)]).tolist()) - hot) for _ in range(30)])
        assert freq.expected_distinct(batch, skip_top=10) == pytest.approx(cold, rel=0.05)


def test_summary_counts_and_order():
    freq = FeatureFrequency.from_counts(np.array([5, 3, 9, 4, 7]), np.array([2, 1, 6, 0, 2]), top_n=3)
    assert (freq.lookups, freq.distinct, freq.singletons) == (11, 4, 1)
    assert freq.top_ids.tolist() == [9, 5, 7]  # count descending, ties by id
    assert freq.probabilities().sum() == pytest.approx(1.0)


def test_meta_round_trip_and_malformed_entry():
    freq = FeatureFrequency.from_ids(np.array([1, 1, 2, 3, 3, 3]), top_n=2)
    back = read_frequency({"frequency": frequency_meta([freq], "counted", 2)})
    assert back is not None
    assert back[0].top_ids.tolist() == [3, 1] and back[0].distinct == 3
    assert read_frequency({}) is None
    bad = frequency_meta([freq], "counted", 2)
    bad["features"][0]["top_counts"] = [1, 5]
    with pytest.raises(ValueError, match="frequency"):
        read_frequency({"frequency": bad})
    with pytest.raises(ValueError, match="source"):
        frequency_meta([freq], "guessed", 2)
