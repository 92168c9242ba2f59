"""EpochOrder: a seeded permutation by position ranges, in memory or per position (Feistel)."""

from __future__ import annotations

import numpy as np
import pytest

from data import shuffle
from data.shuffle import EpochOrder


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 17, 1000, 4097, 65537])
def test_feistel_order_is_a_permutation_that_slices_consistently(monkeypatch, n):
    monkeypatch.setattr(shuffle, "EXPLICIT_MAX", -1)
    order = EpochOrder(n, shuffle=True, seed=3, epoch=1)
    assert order._explicit is None and order._keys is not None
    full = order[0:n]
    assert sorted(full.tolist()) == list(range(n))
    cut = n // 3
    assert np.array_equal(np.concatenate([order[0:cut], order[cut:n]]), full)  # any range, same order
    assert np.array_equal(EpochOrder(n, True, 3, 1)[0:n], full)  # seeded
    if n >= 17:
        assert not np.array_equal(full, np.arange(n))
        assert not np.array_equal(EpochOrder(n, True, 3, 2)[0:n], full)  # a new order every epoch
        assert not np.array_equal(EpochOrder(n, True, 4, 1)[0:n], full)


def test_small_datasets_keep_numpys_permutation():
    order = EpochOrder(1000, shuffle=True, seed=5, epoch=2)
    assert np.array_equal(order[0:1000], np.random.default_rng([5, 2]).permutation(1000))


def test_terabyte_sized_orders_hold_no_per_row_state():
    n = 4_195_197_692  # Criteo Terabyte's 24 days
    order = EpochOrder(n, shuffle=True, seed=0, epoch=0)
    assert order._explicit is None and order._keys.nbytes == 32
    rows = order[n - 300_000 : n]
    assert rows.dtype == np.int64 and len(np.unique(rows)) == 300_000
    assert rows.min() >= 0 and rows.max() < n and rows.max() > n // 2
    plain = EpochOrder(n, shuffle=False, seed=0, epoch=0)
    assert np.array_equal(plain[n - 5 : n], np.arange(n - 5, n))


def test_only_contiguous_slices():
    with pytest.raises(ValueError, match="contiguous"):
        EpochOrder(10, True, 0, 0)[0:10:2]
    with pytest.raises(ValueError, match=">= 0"):
        EpochOrder(-1, True, 0, 0)
