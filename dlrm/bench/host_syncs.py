"""Host synchronisations of one compressed collective, by stage and op, and per iteration at W ranks.

    python -m dlrm.bench.host_syncs [--rows 2048] [--tables 13] [--dim 64] [--peers 2] [--trace]

One chunk as a rank sends it to one peer (Criteo-like single-valued ids, bit-identical rows per
id), through the trainer's own :class:`~dlrm.embedding_comm.codec.DirectionCodec` with
``compression=lossy policy=dual`` (rel bounds, dedup by id) and the fixed-length coder used on
CUDA (``params.entropy=false``), on the device backend (``compression.backend=device``: none of
the host's shortcuts for CPU tensors), each ``.tolist()``/``.cpu()`` counted as a ``host_read``
(:func:`counted_reads`: the dispatcher cannot see them on CPU tensors). Both directions are counted; the
backward also sums duplicate-id gradients (sender) and keeps one row per id (receiver). An
iteration has (W - 1) chunks and one collective per direction; the projection assumes each chunk
is like this one. The payloads are encoded as the transport asks (lengths left on the device) and
read as it reads them (every length at once, then every received head at once).
Then one DCT bucket (``dense_comm=dct``, :func:`count_dct_bucket`) and the static listing of the
per-chunk host copies (:mod:`dlrm.bench.host_copies`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from data.layout import SPARSE_NAMES
from dlrm.bench.criteo_like import KAGGLE_CARDINALITIES, criteo_like_batch
from dlrm.bench.host_copies import host_copies
from dlrm.embedding_comm.codec import DirectionCodec, raise_unless_sound
from dlrm.embedding_comm.config import parse_compression_cfg
from dlrm.embedding_comm.ids import keep_first_duplicates, sum_duplicates
from dlrm.embedding_comm.policy import build_policy, table_stats
from dlrm.telemetry.sync_counter import HostSyncCounter
from dlrm_compression import format as fmt
from dlrm_compression import sparse

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
OVERRIDES = [
    "compression=lossy",
    "policy=dual",
    "compression.forward.params.entropy=false",
    "compression.backward.params.entropy=false",
]
WORLD_SIZES = (2, 8, 64)


@contextmanager
def counted_reads(counter: HostSyncCounter) -> Iterator[None]:
    """Count each ``.tolist()`` / ``.cpu()`` of a tensor as a ``host_read`` in ``counter``: on a
    device each is a copy to the host that waits, and the dispatcher cannot see them on CPU
    tensors (which run the device code with ``backend="device"``)."""
    saved = torch.Tensor.tolist, torch.Tensor.cpu

    def reads(method: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            f = sys._getframe(1)
            counter.note("host_read", f"{os.path.relpath(f.f_code.co_filename)}:{f.f_lineno}", launch=True)
            return method(t, *args, **kwargs)

        return wrapped

    torch.Tensor.tolist = reads(saved[0])  # type: ignore[method-assign]
    torch.Tensor.cpu = reads(saved[1])  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.tolist, torch.Tensor.cpu = saved  # type: ignore[method-assign]


def codecs(
    features: Sequence[str], dim: int, backend: str = "device", overrides: Sequence[str] = OVERRIDES
) -> dict[str, DirectionCodec]:
    """Both directions' codecs as the trainer builds them from the config composed with
    ``overrides``, their stages on ``backend`` (the device's by default: the code a GPU runs,
    here on CPU tensors)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):  # as the trainer composes it
        cfg = compose("config", overrides=[*overrides, f"compression.backend={backend}"])
    spec = parse_compression_cfg(cfg.compression)
    assert spec.forward is not None and spec.backward is not None
    rows = [KAGGLE_CARDINALITIES[i % len(KAGGLE_CARDINALITIES)] for i in range(len(features))]
    modes = {"forward": spec.forward.mode, "backward": spec.backward.mode}
    policy = build_policy(cfg.policy, table_stats(features, rows, dim), modes)
    return {
        "forward": DirectionCodec(spec.forward, "forward", policy, spec.backend),
        "backward": DirectionCodec(spec.backward, "backward", policy, spec.backend),
    }


COLLECTIVE_STAGES = ("size_exchange", "heads")  # once per collective, whatever the number of peers


class RankCollective:
    """One rank's compressed collective with ``peers`` peers, both directions, as the transport
    runs it: forward, it sends each peer the rows of that peer's batch and receives its own
    batch's rows; backward, it sends its batch's gradients and receives each peer's (each batch's
    ids a tensor of its own, so a plan made for one direction serves the other, never the peer's).
    What the peers send is made once, here. :meth:`run` does the rank's codec work, labelled
    ``<direction>/<stage>`` in a counter: per chunk the bounds, duplicate ids, encode and decode;
    per collective the size exchange (every payload's length read at once, as the transport
    does) and the heads (every received payload's header, check and ids counts read at once)."""

    def __init__(
        self,
        rows: int = 2048,
        tables: int = 13,
        dim: int = 64,
        seed: int = 0,
        peers: int = 1,
        device: str = "cpu",
        overrides: Sequence[str] = OVERRIDES,
    ) -> None:
        self.features = SPARSE_NAMES[:tables] if tables <= len(SPARSE_NAMES) else [f"t{k}" for k in range(tables)]
        self.dcs = codecs(self.features, dim, overrides=overrides)
        self.widths, self.shape = [dim] * tables, (rows, tables * dim)

        def batch(s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            b = criteo_like_batch(rows=rows, tables=tables, dim=dim, seed=s)
            values = torch.cat([t["values"] for t in b.values()], 1).to(device)
            grads = torch.randn(rows, tables * dim, generator=torch.Generator().manual_seed(s)).to(device)
            return values, grads, torch.stack([t["ids"] for t in b.values()], 1).to(device)

        own_rows, own_grads, self.own_ids = batch(seed)
        theirs = [batch(seed + 1 + p) for p in range(peers)]
        self.their_ids = [i for _, _, i in theirs]
        self.chunks = {"forward": [r for r, _, _ in theirs], "backward": [own_grads] * peers}
        self.incoming = {
            "forward": [_peer_payload(self.dcs["forward"], own_rows, self.own_ids.clone(), self.features)] * peers,
            "backward": [_peer_payload(self.dcs["backward"], g, i.clone(), self.features) for _, g, i in theirs],
        }

    @property
    def raw_bytes(self) -> int:
        """Bytes of every chunk the rank sends, both directions, as fp32 rows (what raw would send)."""
        return sum(c.numel() * c.element_size() for chunks in self.chunks.values() for c in chunks)

    def fresh_ids(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Copies of this rank's ids and each peer's, carrying no plan (as each iteration's)."""
        return self.own_ids.clone(), [i.clone() for i in self.their_ids]

    def run(self, batch_ids: tuple[torch.Tensor, list[torch.Tensor]], counter: HostSyncCounter | None = None) -> int:
        """The rank's codec work for one collective with ``batch_ids`` (:meth:`fresh_ids`); returns
        the bytes it sends."""
        label = counter.label if counter is not None else (lambda name: nullcontext())
        own, theirs = batch_ids
        send_ids = {"forward": theirs, "backward": [own] * len(theirs)}
        recv_ids = {"forward": [own] * len(theirs), "backward": theirs}
        sent_bytes = 0
        for d, dc in self.dcs.items():
            sent = []
            for chunk, ids in zip(self.chunks[d], send_ids[d], strict=True):
                with label(f"{d}/bounds"):
                    bounds = dc.bounds(chunk, self.widths, dc.policy(self.features, 0))
                summed = d == "backward" and dc.merges_ids(chunk.device)  # the codec sums each id's rows
                if d == "backward" and dc.dedup and not summed:  # the transport's stage sums them
                    with label(f"{d}/sum_duplicates"):
                        chunk = sum_duplicates(chunk, ids, self.widths)
                with label(f"{d}/encode"):
                    sent.append(dc.encode_deferred(chunk, self.widths, bounds, ids, summed=summed))
            with label(f"{d}/size_exchange"):  # the lengths, at most their stored forms' (one op), read at once
                first = self.chunks[d][0]
                stored = dc.stored_size((first.shape[0], first.shape[1]), first.dtype)
                late = [p.length for p in sent if isinstance(p, fmt.Deferred)]
                known = [min(p.numel(), stored) for p in sent if isinstance(p, torch.Tensor)]
                sent_bytes += sum(known) + (sum(torch.stack(late).clamp(max=stored).tolist()) if late else 0)
            payloads = self.incoming[d]
            later = dc.checks_in_decode(payloads[0].device)  # the verdicts read after the decodes
            with label(f"{d}/heads"):
                prepared = [
                    None if later else dc.prepare_decode(p, i, self.features)
                    for p, i in zip(payloads, recv_ids[d], strict=True)
                ]
                heads = fmt.read_heads(
                    [p for p, q in zip(payloads, prepared, strict=True) if q is not None],
                    [q[0] for q in prepared if q is not None],
                    [dc.head_size(len(self.widths)) for q in prepared if q is not None],
                )
                read = iter(heads)
                for q in prepared:
                    if q is not None:
                        next(read).state = q[1]
            heads_of = iter(heads)
            checked: list[tuple[torch.Tensor, str]] = []
            for payload, ids, q in zip(payloads, recv_ids[d], prepared, strict=True):
                naming: dict[str, Any] = dict(
                    src=1, dst=0, features=self.features, tables=self.features, iteration=0, where="bench"
                )
                with label(f"{d}/decode"):
                    if later:
                        dtype = self.chunks[d][0].dtype
                        out, verdict = dc.decode_checked(payload, self.shape, dtype, self.widths, ids, **naming)
                        checked.append((verdict, "bench"))
                    else:
                        head = next(heads_of) if q is not None else None
                        out = dc.decode(payload, self.shape, ids, head=head, **naming)
                if d == "backward" and dc.dedup and not dc.merges_ids(payload.device):  # else the codec kept them
                    with label(f"{d}/keep_first"):
                        keep_first_duplicates(out, ids, self.widths)
            with label(f"{d}/verdicts"):
                raise_unless_sound(checked)
        return sent_bytes


def count_chunk(
    rows: int = 2048,
    tables: int = 13,
    dim: int = 64,
    seed: int = 0,
    trace: bool = False,
    peers: int = 1,
    device: str = "cpu",
    overrides: Sequence[str] = OVERRIDES,
) -> HostSyncCounter:
    """Count one rank's collective in both directions (:class:`RankCollective`). On a CUDA
    ``device`` the codec takes its own device paths and only syncs on device tensors count."""
    collective = RankCollective(rows, tables, dim, seed, peers, device, overrides)
    ids = collective.fresh_ids()
    on_cpu = torch.device(device).type == "cpu"
    counter = HostSyncCounter(count_cpu=on_cpu, trace=trace)
    with counted_reads(counter) if on_cpu else nullcontext(), counter:
        collective.run(ids, counter)
    return counter


def _peer_payload(dc: DirectionCodec, chunk: torch.Tensor, ids: torch.Tensor, features: Sequence[str]) -> torch.Tensor:
    """The payload a peer sends, made as its transport makes it (outside any count)."""
    widths = [chunk.shape[1] // len(features)] * len(features)
    bounds = dc.bounds(chunk, widths, dc.policy(features, 0))
    summed = dc.direction == "backward" and dc.merges_ids(chunk.device)
    if dc.direction == "backward" and dc.dedup and not summed:
        chunk = sum_duplicates(chunk, ids, widths)
    [payload] = fmt.settle([dc.encode_deferred(chunk, widths, bounds, ids, summed=summed)])
    assert payload is not None
    return payload


def per_direction(counter: HostSyncCounter, peers: int = 1) -> dict[str, tuple[float, int]]:
    """(syncs per chunk, syncs per collective) of each direction."""
    out = {}
    for d in ("forward", "backward"):
        mine = {s.split("/", 1)[1]: n for s, n in counter.by_label.items() if s.startswith(d + "/")}
        once = sum(n for s, n in mine.items() if s in COLLECTIVE_STAGES)
        out[d] = ((sum(mine.values()) - once) / peers, once)
    return out


def report(counter: HostSyncCounter, world_sizes: Sequence[int] = WORLD_SIZES, peers: int = 1) -> str:
    """The table by stage and op, the totals per chunk and per collective in each direction, and
    the iteration projection: (W - 1) chunks and one collective per direction."""
    ops = sorted(counter.by_op)
    lines = [f"{'stage':25}" + "".join(f"{op:>{len(op) + 2}}" for op in ops) + f"{'total':>7}"]
    for s in counter.labels:
        cells = "".join(f"{counter.counts[(s, op)] or '':>{len(op) + 2}}" for op in ops)
        lines.append(f"{s:25}{cells}{counter.by_label[s]:>7}")
    per = per_direction(counter, peers)
    (fc, fo), (bc, bo) = per["forward"], per["backward"]
    lines.append(f"per chunk: forward {fc:g}, backward {bc:g}; per collective: forward {fo}, backward {bo}")
    for w in world_sizes:
        total = (w - 1) * (fc + bc) + fo + bo
        lines.append(
            f"W = {w:>3}: {w - 1:>2} peers x (forward {fc:g} + backward {bc:g}) + collectives ({fo} + {bo})"
            f" = {total:,g} host syncs per iteration"
        )
    return "\n".join(lines)


class _Bucket:
    """The part of DDP's ``GradBucket`` a comm hook reads: one bucket of ``module``'s gradients."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.params = list(module.parameters())
        self.buf = torch.cat([p.grad.reshape(-1) for p in self.params if p.grad is not None])

    def buffer(self) -> torch.Tensor:
        return self.buf

    def parameters(self) -> list[torch.nn.Parameter]:
        return self.params

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


def count_dct_bucket(side: int = 1024, keep: float = 0.005, seed: int = 0) -> tuple[int, int]:
    """Host syncs of one ``dense_comm=dct`` bucket (a ``side`` x ``side`` linear layer) on the
    device path: the hook on one rank (compress, the size all-gather and its read, our own
    contribution), and the decode of one other rank's payload (W - 1 of them per bucket)."""
    from dlrm.dense_comm.config import parse_dense_comm_cfg
    from dlrm.dense_comm.hook import DenseComm

    torch.manual_seed(seed)
    layer = torch.nn.Linear(side, side)
    for p in layer.parameters():
        p.grad = torch.randn_like(p)
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dense = DenseComm(parse_dense_comm_cfg({"name": "dct", "keep": keep, "backend": "device"}))
        assert dist.group.WORLD is not None
        dense.prepare(layer, dist.group.WORLD)
        hook, peer = HostSyncCounter(), HostSyncCounter()
        with counted_reads(hook), hook:
            dense.hook(cast(dist.GradBucket, _Bucket(layer))).wait()  # the hook reads only these methods
        assert dense.dct is not None
        codec, f = dense.dct.codec, _Bucket(layer).buffer().view(1, -1)
        mask = codec.mask(f, [f.numel()], [sparse.kth_largest_abs_tensor(f, keep)]).view(-1)
        count, width = int(mask.sum()), int(sparse.delta_width(mask))
        payload = codec.encode_known(f, mask, count, width, [f.numel()])
        with counted_reads(peer), peer:
            codec.decode_known(payload, (1, f.numel()), f.dtype, [f.numel()], count, width)
    finally:
        if own:
            dist.destroy_process_group()
    return hook.total, peer.total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--tables", type=int, default=13)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peers", type=int, default=2, help="chunks per collective (W - 1)")
    p.add_argument("--trace", action="store_true", help="also list each sync's file:line")
    args = p.parse_args(argv)
    counter = count_chunk(args.rows, args.tables, args.dim, args.seed, args.trace, args.peers)
    print(
        f"one collective of {args.peers} chunks, each {args.rows} rows x {args.tables} tables x dim {args.dim}, "
        f"{' '.join(OVERRIDES)}"
    )
    print(report(counter, peers=args.peers))
    if args.trace:
        for site, n in sorted(Counter((e.label, e.op, e.where) for e in counter.events).items()):
            print(f"  {site[0]:25} {site[1]:18} {site[2]}  x{n}")
    hook, peer = count_dct_bucket()
    print(f"one DCT bucket (dense_comm=dct, 1024 x 1024 + 1024, keep 0.005), device path: {hook} host syncs")
    print(f"  + {peer} per other rank's payload decoded: {hook} + (W - 1) x {peer} per bucket at W ranks")
    copies = host_copies()
    print(f"host copies in the per-chunk code (static; on CPU tensors the counter cannot see them): {len(copies)}")
    for c in copies:
        print(f"  {c}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
