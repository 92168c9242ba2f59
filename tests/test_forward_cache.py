"""compression.forward.cache: the sender's mirror and the receiver's cache, codec level and in
real 2-rank training runs."""

from __future__ import annotations

import torch

from dlrm.comm import fixed_bound
from dlrm.comm.codec import DirectionCodec
from dlrm.comm.config import DirectionSpec
from dlrm.comm.forward_cache import ForwardCache


def _contents(fc: ForwardCache, role: str) -> dict:
    return {
        k[2:]: (c.ids(), c.rows(torch.tensor(c.ids(), dtype=torch.int64)))
        for k, c in sorted(fc.caches.items())
        if k[0] == role
    }


def test_receiver_decodes_within_the_bound_and_holds_what_the_sender_mirrors():
    widths, feats = [8, 8, 4], ["a", "b", "c"]
    dc = DirectionCodec(DirectionSpec("lossy", params={"entropy": True}), "forward", fixed_bound(0.01))
    g = torch.Generator().manual_seed(0)
    tables = [torch.randn(50, w, generator=g) for w in widths]
    sender, receiver = ForwardCache(capacity_rows=16), ForwardCache(capacity_rows=16)
    plain = cached = 0
    for step in range(30):
        ids = torch.randint(0, 50, (32, 3), generator=g)
        tables[0] += 0.004 * torch.randn(50, 8, generator=g)  # a: mostly within the bound
        tables[1] += 0.05 * torch.randn(50, 8, generator=g)  # b: mostly past it (differences)
        chunk = torch.cat([t[ids[:, k]] for k, t in enumerate(tables)], dim=1)
        if step == 7:
            chunk[3, 2] = float("nan")  # non-finite values travel exactly, whole
        bounds = [0.01, 0.01, 0.0 if step == 9 else 0.01]  # a zero bound: exact, no differences
        payload, mine = sender.encode(dc, chunk, ids, feats, widths, bounds, dst=1)
        got = receiver.decode(dc, payload, ids, feats, widths, src=0)
        assert torch.equal(got.nan_to_num(7.0), mine.nan_to_num(7.0))
        c = 0
        for k, w in enumerate(widths):
            err = (got[:, c : c + w] - chunk[:, c : c + w]).abs().nan_to_num(0.0)
            assert float(err.max()) <= bounds[k], (step, k)
            c += w
        assert _contents(sender, "send").keys() == _contents(receiver, "recv").keys()
        for key, (sid, srows) in _contents(sender, "send").items():
            rid, rrows = _contents(receiver, "recv")[key]
            assert sid == rid and torch.equal(srows.nan_to_num(7.0), rrows.nan_to_num(7.0)), (step, key)
            assert len(sid) <= 16
        plain += dc.encode(chunk, widths, bounds, ids).numel()
        cached += payload.numel()
    assert cached < plain  # the cache pays on these drifting rows
