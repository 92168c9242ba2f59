"""The receiving side of a compressed all-to-all: :func:`decode` what arrived.

Each peer's part of the received bytes (:func:`incoming`): our own chunk as it is, the rows as
sent (the raw exchange), zeros where nothing was due, else a payload to decode; every payload's
head and what its decoder needs read at once (:func:`read_heads`, the side's one host read);
each payload decoded by a stage or the direction's codec straight into its window of the merged
output (summed ones apart and added), the verdicts of payloads checked as they decode read at
once after. Failures name the receiver, the sender, the tables and the iteration.
"""

from __future__ import annotations

from typing import cast

import torch

from dlrm.embedding_comm.codec import CompressedCommError, raise_unless_sound
from dlrm.embedding_comm.layout import CompressedA2AInfo, ReduceScatterLayout
from dlrm.embedding_comm.send import Transfer
from dlrm.embedding_comm.stage import Blocks, Incoming, Prepared, read_prepared


def decode(info: CompressedA2AInfo, d: str, tr: Transfer, me: int) -> torch.Tensor:
    """Each peer's part of what arrived (:func:`incoming`), every payload's head read at once
    (:func:`read_heads`), then decoded into the merged output (:func:`decode_parts`)."""
    out, parts = incoming(info, d, tr, me)
    if not tr.raw:
        read_heads(info, [p for p in parts if isinstance(p, Incoming)])
    return decode_parts(info, d, out, parts, tr.self_part.dtype)


def decode_parts(
    info: CompressedA2AInfo, d: str, out: torch.Tensor | None, parts: list[torch.Tensor | Incoming], dtype: torch.dtype
) -> torch.Tensor:
    """Each payload decoded (a stage's decoder, else the codec's) into its window of ``out``, or
    apart and summed where ``out`` is None; the verdicts of payloads checked as they decode read
    at once after, before any decoded value leaves."""
    checked: list[tuple[torch.Tensor, str]] = []  # verdicts of payloads checked as they were decoded
    for i, p in enumerate(parts):
        if isinstance(p, Incoming):
            parts[i] = decoded = _decode_one(info, p, dtype, checked)
            for s in info.stages:
                s.after_decode(p, decoded)
    raise_unless_sound(checked)  # (one host read)
    if out is not None:
        return out
    assert isinstance(info.layout, ReduceScatterLayout)  # the one layout whose output() can be None
    return info.layout.merge(d, cast(list[torch.Tensor], parts))  # every part decoded by now


def incoming(
    info: CompressedA2AInfo, d: str, tr: Transfer, me: int
) -> tuple[torch.Tensor | None, list[torch.Tensor | Incoming]]:
    """The merged output (None where parts are summed) and each peer's part: our own chunk, the
    rows as sent (the raw exchange), zeros where nothing was due, else its payload to decode
    (stored where its size is its stored form's, which no coded payload has)."""
    layout, dc = info.layout, info.codecs[d]
    target = layout.output(d, tr.self_part)
    out, windows = target if target is not None else (None, [None] * len(tr.recv_sizes))
    ids_per_peer = info.recv_ids(d)
    parts: list[torch.Tensor | Incoming] = []
    offset = 0
    for peer, n in enumerate(tr.recv_sizes):
        shape, window = layout.recv_shape(d, peer), windows[peer]
        payload, offset = tr.recv_buf[offset : offset + n], offset + n
        if peer == me or tr.raw:  # our own chunk; or every table at none (send_raw): the rows as sent
            part = tr.self_part if peer == me else payload.view(shape)
            parts.append(part if window is None else window.copy_(part))
            continue
        blocks, src, dst = layout.recv_blocks(d, peer), info.global_ranks[peer], info.global_ranks[me]
        _check_size(info, d, n, shape, blocks, src, dst)
        if shape[0] * shape[1] == 0:  # nothing was due (a rank without tables, an empty batch)
            parts.append(tr.self_part.new_zeros(shape) if window is None else window)
            continue
        r = Incoming(
            d,
            peer,
            src,
            dst,
            payload,
            shape,
            ids_per_peer[peer],
            blocks,
            window,
            dc,
            info.stats,
            info.iteration,
            info.where,
        )
        r.stored = n == dc.stored_size(shape, tr.self_part.dtype) and not any(s.decodes(r) for s in info.stages)
        parts.append(r)
    return out, parts


def _check_size(
    info: CompressedA2AInfo, d: str, n: int, shape: tuple[int, int], blocks: Blocks, src: int, dst: int
) -> None:
    """A payload's size against what its shape lets a peer send: none where nothing is due, some where something is."""
    if shape[0] * shape[1] == 0 and n != 0:
        raise CompressedCommError(
            f"rank {dst} ({info.where}): rank {src} sent {n} {d} bytes where none were "
            f"expected (features {blocks.features}, iteration {info.iteration})"
        )
    if shape[0] * shape[1] != 0 and n == 0:
        raise CompressedCommError(
            f"rank {dst} ({info.where}): rank {src} sent no {d} payload for features "
            f"{blocks.features} at iteration {info.iteration} (expected shape {shape})"
        )


def read_heads(info: CompressedA2AInfo, incoming: list[Incoming]) -> None:
    """Every received payload's head and what its decoder (a stage's, else the codec's) needs on
    the host, in one host synchronisation for the collective, set as each one's ``head`` (none
    where the decoder reads for itself, e.g. on the CPU)."""
    todo: list[tuple[Incoming, Prepared]] = []
    for r in incoming:
        if r.stored:  # decoded with its check, nothing read first
            continue
        prepared: Prepared | None = next((p for s in info.stages if (p := s.prepare_decode(r)) is not None), None)
        if prepared is None and not any(s.decodes(r) for s in info.stages):
            if r.dc.checks_in_decode(r.payload.device):  # its verdict is read after the decodes
                r.checked_later = True
                continue
            prepared = r.dc.prepared(r.payload, r.ids, r.blocks.features)
        if prepared is not None:
            todo.append((r, prepared))
    for (r, _), head in zip(todo, read_prepared([r.payload for r, _ in todo], [p for _, p in todo]), strict=True):
        r.head = head


def _decode_one(
    info: CompressedA2AInfo, r: Incoming, dtype: torch.dtype, checked: list[tuple[torch.Tensor, str]]
) -> torch.Tensor:
    """The first stage that decodes the payload, else the direction's codec (a codec that checks
    as it decodes leaves its verdict in ``checked``, read once the collective's decodes are done)."""
    for s in info.stages:
        part = s.decode(r)
        if part is not None:
            return part
    naming = info.naming(r.blocks.features, r.src, r.dst, r.where)
    if r.stored:
        return r.dc.decode_stored(r.payload, r.shape, dtype, r.ids, r.blocks.widths, checked, out=r.window, **naming)
    if r.checked_later:
        out, verdict = r.dc.decode_checked(r.payload, r.shape, dtype, r.blocks.widths, r.ids, out=r.window, **naming)
        checked.append((verdict, r.dc._transfer(r.payload, **naming)))
        return out
    return r.dc.decode(r.payload, r.shape, r.ids, out=r.window, head=r.head, **naming)
