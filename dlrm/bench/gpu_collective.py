"""The compressed all-to-all's codec work on a GPU, per collective, against the raw bytes' wire time.

    python -m dlrm.bench.gpu_collective [--device cuda|cpu] [--sizes 2048x13x64,...]
        [--configs lossy,fp16,bf16,none,ids] [--repeats 10] [--warmup 2] [--json OUT]

For each chunk size (rows x tables x dim) and configuration, one rank's collective with one peer,
both directions, as the trainer runs it (:class:`dlrm.bench.host_syncs.RankCollective`: bounds,
the id plans, encode, the size exchange, the heads, decode; ``lossy`` is ``compression=lossy
policy=dual`` with dedup by id and the fixed-length coder): its launches (dispatcher ops but views
and allocations, a codec op as the kernels its CUDA implementation makes) and host syncs, counted
on CPU tensors running the device backend; on a CUDA ``--device`` also the wall time of the codec
work (median of ``--repeats`` after ``--warmup``, the device synchronised around each, fresh ids
each run so that no plan is reused), GB/s of raw chunk bytes, the raw bytes' time on 100 and 400
Gbit/s links, a plain-torch quantise round trip of the same chunks as the floor, and FBGEMM's
Triton MX4 (``fp32_to_mx4``/``mx4_to_fp32``, what TorchRec's MX4 QComms run) where importable.
``--device cpu`` prints the counts alone: CPU timings say nothing about a GPU.

``ids`` is the input all-to-all's codec (``compression.input=ids``, :class:`IdsCollective`): the
same rank's batch of ids (rows x tables, one id a bag, TorchRec's int32 lengths and int64 ids)
coded for both ranks, and the peer's payload for this rank decoded; its raw bytes are the lengths
and ids TorchRec's all-to-all would send the peer (the dim is not used).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from dlrm.bench.criteo_like import criteo_like_batch
from dlrm.bench.host_syncs import OVERRIDES, RankCollective, counted_reads
from dlrm.telemetry.sync_counter import HostSyncCounter
from dlrm_compression.ids_codec import IdsCodec

SIZES = ((2048, 13, 64), (2048, 26, 128), (8192, 26, 128), (65536, 26, 128))  # the chunks
CONFIGS: dict[str, tuple[str, ...]] = {
    "lossy": tuple(OVERRIDES),
    "fp16": ("compression=fp16",),
    "bf16": ("compression=bf16",),
    "none": ("compression=none",),
    "ids": ("compression.input=ids",),  # the input all-to-all's codec (IdsCollective)
}
BUDGET = {"lossy": 100, "fp16": 10, "bf16": 10, "none": 10, "ids": 100}  # launches per collective, both directions
LINKS_GBIT = (100, 400)


class IdsCollective:
    """One rank's coded input all-to-all with one peer, as :class:`~dlrm.embedding_comm.input_dist.
    CompressedKJTAllToAll` codes it: the rank's batch of ids (``rows`` per table, the tables split
    between the two ranks) encoded for both destinations in one call, and the payload the peer
    sent it decoded (every received payload in one call). :meth:`run` has :class:`RankCollective`'s
    interface; it labels its stages ``ids/encode`` and ``ids/decode``. TorchRec's own splits
    exchange, which the stock all-to-all makes too, is not the codec's and is not counted."""

    def __init__(self, rows: int = 2048, tables: int = 26, seed: int = 0, device: str = "cpu") -> None:
        self.codec = IdsCodec(entropy=False, backend="device")
        self.bags = [rows] * tables
        self.keys_per_dest = [tables // 2, tables - tables // 2]  # this rank's tables first, then the peer's

        def batch(s: int) -> torch.Tensor:
            b = criteo_like_batch(rows=rows, tables=tables, dim=1, seed=s)
            return torch.cat([t["ids"] for t in b.values()]).to(device)

        self.lengths = torch.ones(rows * tables, dtype=torch.int32, device=device)
        self.values = batch(seed)
        peer = self.codec.encode(self.lengths, batch(seed + 1), self.bags, keys_per_dest=self.keys_per_dest)
        self.incoming = [peer[0].clone()]  # the peer's batch for this rank's tables
        self.chunks: dict[str, list[torch.Tensor]] = {}  # (no float chunks: no quantise floor)

    @property
    def raw_bytes(self) -> int:
        """Bytes TorchRec's all-to-all would send the peer: the lengths and ids of its tables."""
        share = sum(self.bags[self.keys_per_dest[0] :])
        return share * (self.lengths.element_size() + self.values.element_size())

    def fresh_ids(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.values.clone(), []

    def run(self, batch_ids: tuple[torch.Tensor, list[torch.Tensor]], counter: HostSyncCounter | None = None) -> int:
        """The rank's codec work for one input all-to-all; returns the bytes it sends the peer."""
        label = counter.label if counter is not None else (lambda name: nullcontext())
        with label("ids/encode"):
            payloads = self.codec.encode(self.lengths, batch_ids[0], self.bags, keys_per_dest=self.keys_per_dest)
        with label("ids/decode"):
            self.codec.decode_all(self.incoming, keys=max(self.keys_per_dest))
        return payloads[1].numel()


Collective = RankCollective | IdsCollective


def collective(size: tuple[int, int, int], config: str, device: str = "cpu") -> Collective:
    """The collective a row of the table measures."""
    rows, tables, dim = size
    if config == "ids":
        return IdsCollective(rows, tables, device=device)
    return RankCollective(rows, tables, dim, device=device, overrides=CONFIGS[config])


def count(collective: Collective) -> tuple[int, int]:
    """(launches, host syncs) of one collective on the device backend, counted on CPU tensors."""
    ids = collective.fresh_ids()
    counter = HostSyncCounter()
    with counted_reads(counter), counter:
        collective.run(ids, counter)
    return sum(counter.launches.values()), counter.total


def timed(fn: Callable[..., Any], repeats: int, warmup: int, setup: Callable[[], Any] | None = None) -> float:
    """Median seconds of ``fn()`` (``fn(setup())`` with a ``setup``, made outside the timing)
    with the device synchronised around each call."""
    times = []
    for i in range(warmup + repeats):
        args = () if setup is None else (setup(),)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(*args)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def floor_seconds(collective: Collective, repeats: int, warmup: int) -> float:
    """A plain-torch quantise round trip of every chunk the rank sends: round(x / 2eb) to int16
    and back, four kernels a chunk; no dedup, no packing, no framing."""
    chunks = [c for cs in collective.chunks.values() for c in cs]

    def run() -> None:
        for c in chunks:
            (torch.round(c * 50.0).to(torch.int16).float() * 0.02).sum()

    return timed(run, repeats, warmup)


def mx4_seconds(collective: Collective, repeats: int, warmup: int) -> float | None:
    """FBGEMM's Triton MX4 encode and decode of every chunk the rank sends (group 32), if importable."""
    try:
        from fbgemm_gpu.quantize_utils import fp32_to_mx4, mx4_to_fp32
    except Exception:  # any reason: not installed, no CUDA build
        return None
    chunks = [c.reshape(-1) for cs in collective.chunks.values() for c in cs]

    def run() -> None:
        for c in chunks:
            mx4_to_fp32(fp32_to_mx4(c, 32), 32)

    return timed(run, repeats, warmup)


def measure(size: tuple[int, int, int], config: str, device: str, repeats: int, warmup: int) -> dict[str, Any]:
    """One row: counts on CPU, and on a CUDA ``device`` the timings."""
    rows, tables, dim = size
    cpu = collective(size, config)
    launches, syncs = count(cpu)
    row: dict[str, Any] = {
        "chunk": f"{rows}x{tables}" if config == "ids" else f"{rows}x{tables}x{dim}",
        "config": config,
        "launches": launches,
        "budget": BUDGET[config],
        "host_syncs": syncs,
        "raw_bytes": cpu.raw_bytes,
    }
    row["sent_bytes"] = cpu.run(cpu.fresh_ids())
    for gbit in LINKS_GBIT:
        row[f"raw_ms_{gbit}g"] = 1e3 * cpu.raw_bytes * 8 / (gbit * 1e9)
    del cpu
    if torch.device(device).type == "cuda":
        gpu = collective(size, config, device)
        seconds = timed(gpu.run, repeats, warmup, setup=gpu.fresh_ids)
        row["codec_ms"] = 1e3 * seconds
        row["gb_per_s"] = gpu.raw_bytes / seconds / 1e9
        if gpu.chunks:  # (the ids codec has no float chunks)
            row["floor_ms"] = 1e3 * floor_seconds(gpu, repeats, warmup)
            mx4 = mx4_seconds(gpu, repeats, warmup)
            row["fbgemm_mx4_ms"] = None if mx4 is None else 1e3 * mx4
    return row


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table (timings "-" where not measured)."""

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.3g}"

    head = (
        "| chunk | config | raw MB | sent MB | codec ms | raw @100G ms | raw @400G ms | floor ms | FBGEMM MX4 ms "
        "| GB/s | launches (budget) | host syncs |"
    )
    lines = [head, "|" + " --- |" * 12]
    for r in rows:
        lines.append(
            f"| {r['chunk']} | {r['config']} | {r['raw_bytes'] / 1e6:.3g} | {r['sent_bytes'] / 1e6:.3g} "
            f"| {ms(r.get('codec_ms'))} | {ms(r['raw_ms_100g'])} | {ms(r['raw_ms_400g'])} | {ms(r.get('floor_ms'))} "
            f"| {ms(r.get('fbgemm_mx4_ms'))} | {ms(r.get('gb_per_s'))} | {r['launches']} ({r['budget']}) "
            f"| {r['host_syncs']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", default=",".join("x".join(map(str, s)) for s in SIZES), help="rows x tables x dim, ...")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", type=Path, help="also write the rows here (the projection's measured input)")
    a = p.parse_args(argv)
    sizes = [tuple(int(v) for v in s.split("x")) for s in a.sizes.split(",")]
    configs = a.configs.split(",")
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown or any(len(s) != 3 for s in sizes):
        p.error(f"--configs from {sorted(CONFIGS)} (got {unknown}); --sizes as ROWSxTABLESxDIM")
    on_gpu = torch.device(a.device).type == "cuda"
    print(
        f"one rank's collective with one peer, both directions, on {a.device}"
        + ("" if on_gpu else " (launch and sync counts only: timings need a GPU)"),
        flush=True,
    )
    rows = []
    for size in sizes:
        for config in configs:
            rows.append(measure(size, config, a.device, a.repeats, a.warmup))  # type: ignore[arg-type]
            print(f"  {rows[-1]['chunk']} {config}: {rows[-1]['launches']} launches", flush=True)
    print(table(rows))
    over = [f"{r['chunk']} {r['config']}: {r['launches']} > {r['budget']}" for r in rows if r["launches"] > r["budget"]]
    print("launch budget: " + ("held everywhere" if not over else "over in " + "; ".join(over)))
    if a.json:
        a.json.write_text(json.dumps({"device": a.device, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
