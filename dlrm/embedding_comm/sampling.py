"""What a sampled send measures of one of its chunks: each table's error and its share of the bytes.

Every ``compression.stats.sample_every`` training iterations a sender measures the first chunk
it encodes, while the bytes travel (:func:`sample`), with every figure read in one host
synchronisation (on a device the decode of its own payload reads that payload's head too):

* each table's worst error: the sender decodes its own payload (or takes what an encoding stage
  says the destination holds) and compares it with the chunk; one segmented maximum over the
  chunk's columns gives every table's at once (``max_abs_error``, ``max_error_over_bound``);
* each table's wire bytes (``sampled_wire_bytes/<f>``, beside its raw bytes
  ``sampled_raw_bytes/<f>``; their quotient is TensorBoard's ``ratio/<f>``): the table's **share
  of the payload its chunk travelled in**, as the payload's sections tell it
  (:meth:`dlrm.embedding_comm.codec.DirectionCodec.block_bytes`: the lossy codec counts each
  block's codes and exceptions, a threshold payload each block's kept entries, a per-block payload
  each group's payload; the header, padding and what is coded jointly go in proportion to the
  widths), in whole bytes that add up to the payload's size exactly. A stored chunk's payload and
  a stage's own (the row cache) are split in proportion to the widths. Nothing is encoded again;
* the rows each table gives the codec (its distinct ids, or rows by value, where the codec
  dedups), which :mod:`dlrm.telemetry.wire` turns into the codec's ratio on what it is given
  (:mod:`dlrm.placement.traffic` predicts the rows).
"""

from __future__ import annotations

from typing import Any

import torch

from dlrm.embedding_comm.codec import abs_error
from dlrm.embedding_comm.ids import sum_duplicates
from dlrm.embedding_comm.stage import Blocks, Outgoing, read_prepared
from dlrm.embedding_comm.stats import CommStats
from dlrm_compression.backend import upload
from dlrm_compression.base import by_width
from dlrm_compression.dedup import distinct_rows, first_capacity


def sample(c: Outgoing, ids: torch.Tensor | None, payload: torch.Tensor, naming: dict[str, Any]) -> None:
    """Measure chunk ``c`` as sent in ``payload`` (``ids``: those it was encoded with, read by
    now); ``naming`` names the transfer in a decode's error (:meth:`CompressedA2AInfo.naming`)."""
    d, dc, blocks, stats = c.direction, c.dc, c.blocks, c.stats
    chunk, widths = c.chunk, blocks.widths
    if c.summed and ids is not None:  # what the codec sent: each id's rows summed (every row holds its sum)
        chunk = sum_duplicates(chunk, ids, widths)
    decoded, device = c.held, chunk.device
    if decoded is None:  # our own payload, its head read as a receiver reads it
        prepared = dc.prepared(payload, ids, blocks.features)
        head = read_prepared([payload], [prepared])[0] if prepared is not None else None
        shape = (chunk.shape[0], blocks.dim)
        decoded = dc.decode(payload, shape, ids, head=head, keep_first=False, **naming)
        shares = dc.block_bytes(payload, widths, head)
    else:  # stored, or a stage's own payload
        shares = by_width(payload.numel(), widths, device)
    col_err = abs_error(decoded.float(), chunk.float()).amax(dim=0)
    errors = torch.segment_reduce(col_err, "max", lengths=upload(torch.tensor(widths), device), initial=0.0)
    figures = [distinct(chunk, widths, ids, dc.dedup), errors.double(), shares.to(device, torch.float64)]
    if c.bounds is not None:
        # (a list of bounds as float32 first, as the figure has always been taken)
        b = torch.as_tensor(c.bounds).to(device, torch.float64, non_blocking=True)
        e = figures[1]
        zero_or_inf = torch.where(e == 0, 0.0, torch.inf).to(e)
        figures.append(torch.where(b > 0, e / b.clamp_min(torch.finfo(torch.float64).tiny), zero_or_inf))
    read = torch.cat([f.to(torch.float64) for f in figures]).tolist()  # the one read of every figure
    nb = len(widths)
    rows, errs, sizes = read[:nb], read[nb : 2 * nb], apportion(read[2 * nb : 3 * nb], payload.numel())
    over = read[3 * nb :]
    elt = chunk.element_size()
    for k, (f, w) in enumerate(zip(blocks.features, widths, strict=True)):
        if not w:  # (no values: no error, no bytes)
            continue
        stats.maximum(f"{d}/max_abs_error/{f}", errs[k])
        stats.maximum(f"{d}/max_abs_error", errs[k])
        if over:
            stats.maximum(f"{d}/max_error_over_bound", over[k])
        stats.add(f"{d}/sampled_raw_bytes/{f}", chunk.shape[0] * w * elt)
        stats.add(f"{d}/sampled_wire_bytes/{f}", sizes[k])
    _given(stats, d, chunk, blocks, [int(n) for n in rows], "ids" if ids is not None else "rows")


def sample_exact(stats: CommStats, d: str, chunk: torch.Tensor, blocks: Blocks) -> None:
    """A chunk that travels as its rows (compression=auto's passthrough): each table's sampled
    wire bytes are its raw bytes, its error 0."""
    for f, w in zip(blocks.features, blocks.widths, strict=True):
        stats.add(f"{d}/sampled_raw_bytes/{f}", chunk.shape[0] * w * chunk.element_size())
        stats.add(f"{d}/sampled_wire_bytes/{f}", chunk.shape[0] * w * chunk.element_size())
        stats.maximum(f"{d}/max_abs_error/{f}", 0.0)


def apportion(shares: list[float], total: int) -> list[int]:
    """``shares`` (summing to ``total`` up to rounding) as whole bytes summing to ``total``
    exactly: each share's floor, and the bytes left to the largest remainders (ties: first)."""
    floors = [int(s // 1) for s in shares]
    left = total - sum(floors)
    order = sorted(range(len(shares)), key=lambda k: floors[k] - shares[k])  # largest remainder first
    for k in order[: max(left, 0)]:
        floors[k] += 1
    return floors


def distinct(chunk: torch.Tensor, widths: list[int], ids: torch.Tensor | None, dedup: bool) -> torch.Tensor:
    """Per table, the rows the codec is given, on the chunk's device: its distinct ids, or its
    distinct rows by value, when the codec dedups; else all its rows."""
    if not dedup or not widths:
        return torch.full((len(widths),), chunk.shape[0], dtype=torch.int64, device=chunk.device)
    if ids is not None:
        return first_capacity(ids)[0]
    return distinct_rows(chunk, widths)


def _given(stats: CommStats, d: str, chunk: torch.Tensor, blocks: Blocks, rows: list[int], mode: str) -> None:
    """The rows each table gives the codec and their bytes against the chunk's, per mode (``ids``:
    chunks with single ids; ``rows``: the rest, e.g. row-wise partial sums), so that
    dlrm/telemetry/wire.py knows the codec's ratio on what it is given."""
    elt = chunk.element_size()
    for f, n in zip(blocks.features, rows, strict=True):
        stats.add(f"{d}/sampled_chunks/{f}", 1)
        stats.add(f"{d}/sampled_rows/{f}", n)
    stats.add(f"{d}/sampled_given_bytes/{mode}", sum(n * w for n, w in zip(rows, blocks.widths, strict=True)) * elt)
    stats.add(f"{d}/sampled_chunk_bytes/{mode}", chunk.numel() * elt)
