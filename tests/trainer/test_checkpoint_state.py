"""What a rank's checkpoint file holds survives ``torch.load(weights_only=True)`` and restores
exactly: the random streams, and the row caches (a restored copy continues as the original)."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch

from dlrm.trainer.state import RngState
from dlrm_compression.row_cache import RowCache


def _through_a_file(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


def _draws() -> list:
    out = [torch.rand(3).tolist(), np.random.randn(3).tolist(), [random.random() for _ in range(3)]]
    if torch.cuda.is_initialized():
        out.append(torch.rand(3, device="cuda").tolist())
    return out


@pytest.mark.parametrize(
    "cuda", [False, pytest.param(True, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
)
def test_random_streams_restore_exactly_from_plain_data(cuda):
    if cuda:
        torch.zeros(1, device="cuda")  # initialise CUDA: its generators are saved from then on
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    np.random.randn()  # a cached gaussian is part of numpy's state
    saved = _through_a_file(RngState().state_dict())
    assert ("cuda" in saved) == cuda
    expected = _draws()
    _draws()  # move every stream on
    RngState().load_state_dict(saved)
    assert _draws() == expected


def test_a_restored_row_cache_answers_and_evicts_as_the_original():
    gen = torch.Generator().manual_seed(0)
    first = RowCache(4, capacity_rows=40)
    for _ in range(20):
        ids = torch.randint(0, 100, (15,), generator=gen).unique()
        first.store(ids, torch.randn(len(ids), 4, generator=gen))
    copy = RowCache(4, capacity_rows=40)
    copy.load_state_dict(_through_a_file(first.state_dict()))
    for _ in range(20):  # both driven alike from here: same ids held, same rows, same evictions
        ids = torch.randint(0, 100, (15,), generator=gen).unique()
        rows = torch.randn(len(ids), 4, generator=gen)
        assert torch.equal(first.lookup(ids)[1], copy.lookup(ids)[1])
        first.store(ids, rows), copy.store(ids, rows)
        assert first.ids() == copy.ids()
    with pytest.raises(ValueError, match="capacity_rows"):
        RowCache(4, capacity_rows=41).load_state_dict(first.state_dict())
