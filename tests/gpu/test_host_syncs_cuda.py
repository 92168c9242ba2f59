"""One chunk's host synchronisations on CUDA, counted twice: by the dispatch-level counter and by
CUDA's own sync debug mode (``torch.cuda.set_sync_debug_mode("warn")``). Both are printed."""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch

from dlrm.bench.host_syncs import RankCollective, count_chunk, report
from dlrm.telemetry.sync_counter import HostSyncCounter

NO_CUDA = "needs a CUDA device (torch.cuda.is_available() is False here); run `make test-gpu` on a GPU machine"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]
SYNC_WARNING = "called a synchronizing CUDA operation"


def test_cuda_sync_debug_mode_confirms_the_counters_figure_for_one_chunk() -> None:
    count_chunk(rows=256, tables=2, dim=8, device="cuda")  # warm-up: kernels compiled, caches filled
    collective = RankCollective(device="cuda")  # the chunks and the peers' payloads: made outside the count
    ids = collective.fresh_ids()
    torch.cuda.synchronize()
    counter = HostSyncCounter(count_cpu=False, trace=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with counter:
                collective.run(ids, counter)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    seen = [w for w in caught if SYNC_WARNING in str(w.message)]
    sites = Counter(f"{w.filename}:{w.lineno}" for w in seen)
    print("one chunk on CUDA (2048 rows x 13 tables x dim 64), dispatch-level counter:")
    print(report(counter))
    print(f"torch.cuda.set_sync_debug_mode('warn'): {len(seen)} synchronising CUDA operations")
    for site, n in sites.most_common():
        print(f"  {site}  x{n}")
    by_site = Counter(f"{e.label} {e.op} {e.where}" for e in counter.events)
    assert counter.total == len(seen), (
        f"the counter saw {counter.total} host syncs, CUDA's debug mode {len(seen)}:\n"
        f"counter: {dict(by_site)}\ndebug mode: {dict(sites)}"
    )
