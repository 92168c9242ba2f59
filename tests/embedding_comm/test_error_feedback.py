"""Error feedback on the backward all-to-all: the residual is what the real codec lost, and what
reaches the owner for an id sums to its gradients within one bound (without it: nothing)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import dlrm_compression as compression
from dlrm.embedding_comm.config import parse_compression_cfg
from dlrm.embedding_comm.error_feedback import ErrorFeedback
from dlrm.embedding_comm.ids import sum_duplicates
from dlrm.embedding_comm.stage import Blocks, Outgoing

WIDTHS = [4, 3]
BLOCKS = Blocks(["cat_0", "cat_1"], WIDTHS)


def outgoing(chunk: torch.Tensor, ids: torch.Tensor, bounds: list[float] | torch.Tensor) -> Outgoing:
    dc = SimpleNamespace(dedup=True)
    return Outgoing("backward", 1, 1, chunk, ids, BLOCKS, bounds, dc, None, single=None)  # type: ignore[arg-type]


def codec_roundtrip(chunk: torch.Tensor, ids: torch.Tensor, bounds: list[float] | torch.Tensor) -> torch.Tensor:
    codec = compression.get_codec("lossy")
    return codec.decode(codec.encode(chunk, bounds, ids=ids, blocks=WIDTHS), ids=ids)


@pytest.mark.parametrize("device_bounds", [False, True])
def test_residual_is_what_the_codec_loses_for_each_id(device_bounds):
    torch.manual_seed(0)
    ids = torch.tensor([[3, 1], [5, 1], [3, 0], [7, 2]])
    grads = sum_duplicates(torch.randn(4, 7) * 0.01, ids, WIDTHS)  # what DuplicateIds hands on
    bounds: list[float] | torch.Tensor = [0.004, 0.0031]
    if device_bounds:  # rel mode: a float64 tensor from relative_to_absolute
        bounds = torch.tensor(bounds, dtype=torch.float64)
    ef = ErrorFeedback({"cat_0": 8, "cat_1": 3})
    c = outgoing(grads, ids, bounds)
    ef.before_encode(c)
    assert torch.equal(c.chunk, grads)  # no residual yet
    lost = grads - codec_roundtrip(c.chunk, ids, bounds)
    r0, r1 = ef.residuals["1/0"], ef.residuals["1/1"]
    assert torch.equal(r0[ids[:, 0]], lost[:, :4]) and torch.equal(r1[ids[:, 1]], lost[:, 4:])
    assert r0[[0, 1, 2, 4, 6]].abs().sum() == 0  # ids never sent keep none
    assert lost.abs().max() > 0  # the bounds are coarse enough to lose something
    # the next send of id 3 (table cat_0) carries its residual
    c2 = outgoing(torch.zeros(1, 7), torch.tensor([[3, 2]]), bounds)
    ef.before_encode(c2)
    assert torch.equal(c2.chunk[0, :4], lost[0, :4]) and torch.equal(c2.chunk[0, 4:], lost[3, 4:])


def test_small_gradients_arrive_in_sum_with_feedback_and_vanish_without():
    eb, g, sends = 0.01, 0.003, 40  # every gradient entry below the bound: each rounds to 0 alone
    ids = torch.tensor([[0, 0]])
    ef = ErrorFeedback({"cat_0": 1, "cat_1": 1})
    got = torch.zeros(1, 7)
    for _ in range(sends):
        c = outgoing(torch.full((1, 7), g), ids, [eb, eb])
        ef.before_encode(c)
        got += codec_roundtrip(c.chunk, ids, [eb, eb])
    assert codec_roundtrip(torch.full((1, 7), g), ids, [eb, eb]).abs().sum() == 0  # without feedback
    assert (got - sends * g).abs().max() <= eb + 1e-6  # with it: the sum within one bound


def test_error_feedback_config_is_backward_lossy_by_id():
    base = {"codec": "lossy", "mode": "rel", "dedup": True}
    spec = parse_compression_cfg({"forward": base, "backward": {**base, "error_feedback": True}})
    assert spec.backward is not None and spec.backward.error_feedback
    bad = [
        ({"forward": {**base, "error_feedback": True}, "backward": base}, r"compression\.forward\.error_feedback"),
        (
            {"forward": base, "backward": {**base, "dedup": False, "error_feedback": True}},
            r"compression\.backward\.error_feedback needs",
        ),
        ({"forward": base, "backward": {**base, "error_feedback": "yes"}}, r"error_feedback must be true or false"),
    ]
    for cfg, message in bad:
        with pytest.raises(ValueError, match=message):
            parse_compression_cfg(cfg)
