"""The output all-to-all's dedup by id takes the coded input all-to-all's sorted ids of the same
batch (compression.input=ids) instead of sorting them again: the same plans as an independent
``torch.unique`` of the ids, the same bytes and numbers, and a sort only where the plan does not fit."""

from __future__ import annotations

import pytest
import torch
from multiprocess import run_ranks
from test_comm import LOSSY, build, full_weights, local_weights, ours, pipeline_batches
from torchrec import KeyedJaggedTensor

from dlrm.embedding_comm import ids as ids_mod
from dlrm.embedding_comm.ids import Region, attach_plans, first_rows, pending_ids, sum_duplicates
from dlrm_compression import dedup
from dlrm_compression.ids_codec import IdsCodec
from dlrm_compression.lossy import LossyCodec

LOSSY_IDS = {**LOSSY, "input": "ids"}


def unique_plan(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts, inverse [n_blocks, rows]) of ids [rows, n_blocks] by torch.unique, block by block."""
    parts = [torch.unique(ids[:, b], sorted=True, return_inverse=True) for b in range(ids.shape[1])]
    counts = torch.tensor([u.numel() for u, _ in parts], dtype=torch.int64)
    return counts, torch.stack([inv for _, inv in parts]) if parts else torch.zeros(0, ids.shape[0])


_SORTS = ((dedup, "_sorted_runs"), (dedup, "_unique"), (torch, "sort"))  # dedup's numpy/torch sorts, first_rows'


class Sorts:
    """Counts the calls of the sort routines of dedup and of the duplicate-id rows in this
    process, from now on (until ``monkeypatch`` undoes it, or :meth:`stop`)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch | None = None) -> None:
        self.calls = 0
        self.saved = [getattr(mod, name) for mod, name in _SORTS]
        for mod, name in _SORTS:
            wrapped = self._counted(getattr(mod, name))
            if monkeypatch is not None:
                monkeypatch.setattr(mod, name, wrapped)
            else:
                setattr(mod, name, wrapped)

    def stop(self) -> None:
        for (mod, name), fn in zip(_SORTS, self.saved, strict=True):
            setattr(mod, name, fn)

    def _counted(self, fn):
        def wrapped(*args, **kwargs):
            self.calls += 1
            return fn(*args, **kwargs)

        return wrapped


def test_the_ids_codec_plans_are_torch_uniques_and_say_which_keys_have_one_id_per_bag():
    g = torch.Generator().manual_seed(3)
    one = (torch.rand(40, generator=g) ** 3 * 50).long()
    multi = [7, 7, 3, 9, 1, 2]  # key b: bags of 2, 0, 1, 3 ids (and 16 empty ones)
    lengths = torch.tensor([1] * 20 + [2, 0, 1, 3] + [0] * 16 + [1] * 20, dtype=torch.int32)
    values = torch.cat([one[:20], torch.tensor(multi), one[20:]])
    _, plans = IdsCodec().encode_with_plan(lengths, values, [20, 20, 20], keys_per_dest=[2, 1])
    payloads = IdsCodec().encode(lengths, values, [20, 20, 20], keys_per_dest=[2, 1])
    back = [IdsCodec().decode(p).plan for p in payloads]
    assert plans.single == [True, False, True] and back[0].single == [True, False] and back[1].single == [True]
    for k, (ids, dec, kk) in enumerate(
        ((one[:20], back[0], 0), (torch.tensor(multi), back[0], 1), (one[20:], back[1], 0))
    ):
        u, inv = torch.unique(ids, sorted=True, return_inverse=True)
        for p, key in ((plans, k), (dec, kk)):
            assert int(p.distinct[key]) == u.numel() and torch.equal(p.key_index(key), inv)


def _single_id_kjt(seed: int, stride: int = 12) -> KeyedJaggedTensor:
    """Three keys of skewed ids, one per bag."""
    g = torch.Generator().manual_seed(seed)
    values = (torch.rand(3 * stride, generator=g) ** 3 * 40).long()
    kjt = KeyedJaggedTensor(
        keys=["a", "b", "c"], values=values, lengths=torch.ones(3 * stride, dtype=torch.int32), stride=stride
    )
    return kjt


def test_a_region_takes_the_plan_only_where_every_key_has_one_for_exactly_its_bags(monkeypatch):
    kjt = _single_id_kjt(0)
    _, plans = IdsCodec().encode_with_plan(kjt.lengths(), kjt.values(), [12, 12, 12])
    attach_plans(kjt, plans, 0, [0, 0, 0])
    regions = [Region(0, 3, 0, 12), Region(1, 2, 0, 12), Region(0, 2, 0, 6), Region(0, 1, 4, 8)]
    pending = pending_ids([(kjt, regions)])
    whole, tail, half, later = pending.candidates[0]
    assert pending.reused == 2
    for ids in (whole, tail):
        counts, inverse = dedup.known_plan(ids)
        want = unique_plan(ids)
        assert torch.equal(counts, want[0]) and torch.equal(inverse, want[1])
    assert dedup.known_plan(half) is None and dedup.known_plan(later) is None  # other bags: sorted again
    other = _single_id_kjt(0)  # the same ids in another KJT object: no plan
    assert dedup.known_plan(pending_ids([(other, regions[:1])]).candidates[0][0]) is None
    monkeypatch.setattr(ids_mod, "REUSE_INPUT_PLANS", False)
    assert pending_ids([(kjt, regions)]).reused == 0


def test_a_key_with_an_empty_bag_takes_no_plan():
    lengths = torch.tensor([1, 1, 1, 0, 1, 1], dtype=torch.int32)
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([4, 4, 2, 5, 5]), lengths=lengths, stride=3)
    _, plans = IdsCodec().encode_with_plan(kjt.lengths(), kjt.values(), [3, 3])
    attach_plans(kjt, plans, 0, [0, 0])
    a, b = pending_ids([(kjt, [Region(0, 1, 0, 3), Region(1, 1, 0, 3)])]).candidates[0]
    assert dedup.known_plan(a) is not None and dedup.known_plan(b) is None  # b's empty bag is EMPTY_BAG


@pytest.mark.parametrize("device_path", [False, True], ids=["host", "device"])
def test_dedup_with_a_known_plan_sorts_nothing_and_gives_the_same_payloads(monkeypatch, device_path):
    """On the host backend (numpy's sorts, crc32) and on the device's (torch's sorts, Adler-32)
    run on CPU tensors."""
    from dlrm_compression.format import settle

    kjt = _single_id_kjt(1, stride=64)
    _, plans = IdsCodec().encode_with_plan(kjt.lengths(), kjt.values(), [64, 64, 64])
    attach_plans(kjt, plans, 0, [0, 0, 0])
    known = pending_ids([(kjt, [Region(0, 3, 0, 64)])]).candidates[0][0]
    plain = known.clone()  # the same ids, no plan
    assert dedup.known_plan(known) is not None and dedup.known_plan(plain) is None
    table = torch.randn(40, 3, 8)
    x = table[plain, torch.arange(3)].reshape(64, 24)  # rows of an id alike, per block (the contract)
    g = torch.randn(64, 24)
    codec = LossyCodec(entropy=False).with_backend("device" if device_path else "host")
    numpy = codec.backend_for(x.device).numpy_sorts  # dedup's own calls below take the codec's sorts
    assert numpy is not device_path
    bounds, widths = [1e-2] * 3, [8, 8, 8]
    got, sorts = {}, {}
    for name, ids in (("plain", plain), ("known", known)):
        counter = Sorts(monkeypatch)
        payload = codec.encode(x, bounds, ids)
        deferred = settle([codec.encode_deferred(x, bounds, ids)])[0]
        counts, first, inverse = dedup.unique_per_block(ids, numpy=numpy)
        cap_counts, cap_first, cap_inverse = dedup.plan_capacity(ids)
        got[name] = [
            payload,
            deferred,
            codec.decode(payload, ids),
            sum_duplicates(g, ids, widths),
            first_rows(ids),
            counts,
            inverse,
            ids.t().reshape(-1)[first + torch.repeat_interleave(torch.arange(3) * 64, counts)],  # the sources' ids
            cap_counts,
            cap_inverse,
            ids.t().gather(1, cap_first),
        ]
        sorts[name] = counter.calls
    for k, (a, b) in enumerate(zip(got["plain"], got["known"], strict=True)):
        assert a is not None and torch.equal(a, b), k
    want_counts, want_inverse = unique_plan(plain)
    assert torch.equal(got["known"][5], want_counts) and torch.equal(got["known"][6], want_inverse)
    assert sorts["known"] == 0 < sorts["plain"]


def _pipelined_reuse(rank: int, ws: int) -> dict:
    """TorchRec's pipeline (the input dist a batch ahead) at 2 ranks: every plan a chunk's ids take
    equals torch.unique of those ids; the numbers equal those of the sorting runs."""
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from dlrm.telemetry.comm_stats import comm_stats

    checked = []
    attach = ids_mod.with_known_plan

    def checking(ids: torch.Tensor, counts: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        want = unique_plan(ids)
        assert torch.equal(counts, want[0]) and torch.equal(inverse, want[1]), f"rank {rank}: a mismatched plan"
        checked.append(ids.shape)
        return attach(ids, counts, inverse)

    ids_mod.with_known_plan = checking
    data = pipeline_batches(rank, 5, [16, 10])
    runs = {}
    for name, cfg, reuse in (("lossy", LOSSY, True), ("ids", LOSSY_IDS, True), ("ids_sorted", LOSSY_IDS, False)):
        ids_mod.REUSE_INPUT_PLANS = reuse
        piped = build(ours(cfg), "mixed", ws, full_weights(5), pipe=True)
        dense = [p for n, p in piped.named_parameters() if n.endswith("scale")]
        pipeline = TrainPipelineSparseDist(piped, torch.optim.SGD(dense, lr=0.0), torch.device("cpu"))
        it, outs, sorts = iter(data), [], Sorts()
        while True:
            try:
                outs.append(pipeline.progress(it))
            except StopIteration:
                break
        sorts.stop()
        weights = local_weights(piped)
        runs[name] = (outs, weights, sorts.calls, comm_stats(piped), len(checked))
        checked.clear()
    ids_mod.REUSE_INPUT_PLANS, ids_mod.with_known_plan = True, attach
    ref = runs["lossy"]
    for name in ("ids", "ids_sorted"):
        outs, weights = runs[name][:2]
        assert len(outs) == len(ref[0]) == 5
        assert all(torch.equal(a, b) for a, b in zip(ref[0], outs, strict=True)), name
        assert weights.keys() == ref[1].keys() and all(torch.equal(weights[k], ref[1][k]) for k in weights), name
    return {name: {"sorts": r[2], "checked": r[4], **r[3]} for name, r in runs.items()}


def test_the_pipelined_output_dist_reuses_the_input_plans_of_its_own_batch_2_ranks():
    for s in run_ranks(_pipelined_reuse, 2):
        on, off, plain = s["ids"], s["ids_sorted"], s["lossy"]
        # the mixed plan's table/column-wise chunks, both sides, take their batch's plan where its
        # input payload was coded (a stored one, which these small batches can make, carries none)
        assert on["comm/ids/plans"] == off["comm/ids/plans"] == plain["comm/ids/plans"] > 0
        assert 0 < on["comm/ids/plans_reused"] == on["checked"] <= on["comm/ids/plans"]
        assert off["comm/ids/plans_reused"] == plain["comm/ids/plans_reused"] == 0 == off["checked"]
        assert on["sorts"] < off["sorts"], (on["sorts"], off["sorts"])
