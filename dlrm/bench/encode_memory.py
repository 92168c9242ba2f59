"""Peak transient memory of one deferred encode (the device path's), attributed to where it is
allocated.

    python -m dlrm.bench.encode_memory [--rows 2048] [--tables 13] [--dim 64] [--mode ids|value]

One chunk of Criteo-like single-valued ids (``ids``: deduplicated by id; ``value``: by value)
through :meth:`LossyCodec.encode_deferred` with the fixed-length coder, on the device backend
run on CPU tensors (``backend="device"``: none of the host's shortcuts; the CPU's torch reference
of the block coder, where a GPU runs Triton). torch.profiler records every allocation and free of the
second encode (the first warms caches); the peak of the bytes alive during it (the payload's
own buffer, which outlives the call, included) is printed against the chunk's size with the
allocations alive at that peak, by the two innermost frames of this project that made them.
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Sequence

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from dlrm_compression.lossy import LossyCodec


def peak_of_encode(rows: int, tables: int, dim: int, mode: str) -> tuple[int, int, Counter[str]]:
    """(peak bytes alive during one encode, the chunk's bytes, the bytes alive at the peak by site)."""
    g = torch.Generator().manual_seed(0)
    ids = (torch.rand(rows, tables, generator=g) ** 3 * 1000).long()
    table = torch.randn(tables, 1000, dim, generator=g)
    x = torch.cat([table[k][ids[:, k]] for k in range(tables)], 1).contiguous()
    codec = LossyCodec(entropy=False).with_backend("device")
    bounds = torch.full((tables,), 1e-3, dtype=torch.float64)
    codec.encode_deferred(x, bounds, ids if mode == "ids" else None, blocks=[dim] * tables)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
        codec.encode_deferred(x, bounds, ids if mode == "ids" else None, blocks=[dim] * tables)
    allocs: list[tuple[int, int, int, list[str]]] = []

    def walk(node, frames: list[str]) -> None:
        if node.tag == _EventType.PyCall:
            frames = [*frames, str(node.name)]
        if node.tag == _EventType.Allocation:
            allocs.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size, frames))
        for c in node.children:
            walk(c, frames)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, [])
    live: dict[int, tuple[int, list[str]]] = {}
    now = peak = 0
    at_peak: dict[int, tuple[int, list[str]]] = {}
    for _, ptr, size, frames in sorted(allocs, key=lambda a: a[0]):
        if size > 0:
            live[ptr] = (size, frames)
            now += size
        elif ptr in live:
            now -= live.pop(ptr)[0]
        if now > peak:
            peak, at_peak = now, dict(live)
    sites: Counter[str] = Counter()
    for size, frames in at_peak.values():
        ours = [f for f in frames if "compression/" in f or "dlrm/" in f]
        sites[" <- ".join(reversed(ours[-2:])) if ours else "(outside)"] += size
    return peak, x.numel() * x.element_size(), sites


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--tables", type=int, default=13)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--mode", choices=["ids", "value"], default="ids")
    a = p.parse_args(argv)
    peak, chunk, sites = peak_of_encode(a.rows, a.tables, a.dim, a.mode)
    mib = 2.0**20
    print(f"chunk {chunk / mib:.2f} MiB; peak during one encode {peak / mib:.2f} MiB = {peak / chunk:.1f}x the chunk")
    for site, n in sites.most_common(8):
        print(f"  {n / mib:8.2f} MiB  {site}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
