"""DCT's payloads: how one rank's selection is coded, how every rank learns its size, and how a
received one is read back.

Each payload is sized by one 8-byte word that its sender sends first, read by every rank with
the bucket's other numbers (:mod:`.aggregation`). The codec decides what the word is:

* **count and delta width** (cast values, positions coded on the device: a GPU's, or the device
  backend on a CPU): every side computes the payload's size from them, so the payload is coded
  after the read and decoded without one (:meth:`ThresholdCodec.encode_known`,
  :meth:`~ThresholdCodec.decode_known`); a received payload's check is a 0-d tensor, read with
  the other received ones' at once, before any of their values is used;
* **the payload's length** (positions zstd-coded on the host: the host backend's measured
  shortcut on a CPU, smaller and faster there; or lossy values, whose size only coding tells):
  the payload is coded first, and a received one is checked as it is decoded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

import dlrm_compression as compression
from dlrm_compression.format import PayloadError
from dlrm_compression.positions import width_less_one
from dlrm_compression.sparse import Threshold, ThresholdCodec


@dataclass(frozen=True)
class Coding:
    """DCT's codec on one device: :attr:`by_count` says which word sizes a payload."""

    codec: ThresholdCodec
    by_count: bool  # the word is the count and delta width (else the payload's length)

    @staticmethod
    def of(codec: ThresholdCodec, device: torch.device) -> Coding:
        return Coding(codec, codec.values != "lossy" and not codec.coded_on_host(device))

    def mask(
        self,
        x: torch.Tensor,
        blocks: Sequence[int],
        thresholds: Sequence[Threshold],
        mags: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Which entries of ``x`` (flat, in ``blocks``) travel: ``|x| >=`` their block's threshold,
        or NaN; ``mags``: ``x``'s :func:`~compression.sparse.magnitudes`, made already (float32 ``x``)."""
        if mags is not None:
            return self.codec.mask_of(mags, blocks, thresholds)
        return self.codec.mask(x.view(1, -1), blocks, thresholds).view(-1)

    def sent(
        self, x: torch.Tensor, keep: torch.Tensor, payload: torch.Tensor | None, zero: torch.Tensor | None = None
    ) -> torch.Tensor:
        """What every receiver decodes of this rank's selection ``keep`` of ``x``: decoded from
        ``payload`` where it is coded first (lossy values are known from it alone; so the host
        coding's NaNs keep the bits its decode gives them), computed from ``x`` otherwise
        (``zero``: :meth:`ThresholdCodec.sent`'s)."""
        if not self.by_count:
            return self.codec.decode(_made(payload)).view(-1)
        return self.codec.sent(x, keep, zero)

    def first(
        self,
        x: torch.Tensor,
        keep: torch.Tensor,
        blocks: Sequence[int],
        thresholds: Sequence[Threshold],
        eb: float | None,
        halves: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The word of this rank's payload of ``x`` where ``keep`` is set (a 0-d int64 tensor on
        ``x``'s device), and the payload where it must be coded before its size is known.
        ``halves``: :func:`~compression.positions.width_less_one`'s, made once per layout."""
        if self.by_count:
            return torch.add(width_less_one(keep, halves), keep.sum(), alpha=64), None  # count and delta width (1..64)
        payload = self.codec.encode(x.view(1, -1), eb, blocks=blocks, thresholds=thresholds)
        return torch.tensor(payload.numel(), dtype=torch.int64, device=x.device), payload

    def size(self, n: int, blocks: Sequence[int], word: int) -> int:
        """Bytes of a payload of ``n`` entries in ``blocks`` sized by ``word``."""
        return self.codec.payload_size(n, blocks, word >> 6, (word & 63) + 1) if self.by_count else word

    def count(self, word: int, payload: torch.Tensor | None) -> int:
        """How many entries this rank's payload (sized by ``word``) carries."""
        return word >> 6 if self.by_count else self.codec.count(_made(payload))

    def encoded(
        self,
        x: torch.Tensor,
        keep: torch.Tensor,
        blocks: Sequence[int],
        word: int,
        payload: torch.Tensor | None,
        ramp: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This rank's payload of ``x`` where ``keep`` is set, once ``word`` is read (or as made
        first). ``ramp``: :func:`~compression.positions.ramp_of` the bucket, made once (also :meth:`decode`'s)."""
        if not self.by_count:
            return _made(payload)
        return self.codec.encode_known(x.view(1, -1), keep, word >> 6, (word & 63) + 1, blocks, ramp=ramp)

    def decode(
        self,
        part: torch.Tensor,
        n: int,
        dtype: torch.dtype,
        blocks: Sequence[int],
        word: int,
        at: tuple[torch.Tensor, int] | None = None,
        ramp: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A received payload of ``n`` entries in ``blocks``, sized by ``word``: its values (flat;
        with ``at``, (positions, size), placed at those positions of zeros of that size), and
        its check as a 0-d tensor (1: it holds) still to be read (None: checked already)."""
        size = n if at is None else at[1]
        if self.by_count:
            idx, values, ok = self.codec.known_entries(part, n, blocks, word >> 6, (word & 63) + 1, ramp)
            dense = torch.zeros(size, dtype=dtype, device=part.device)  # as decode: the cast's fp32, then dtype
            return dense.index_copy_(0, idx if at is None else at[0].index_select(0, idx), values.to(dtype)), ok
        decoded = compression.decode(part)
        if decoded.numel() != n:
            raise PayloadError(f"{decoded.numel()} gradients, expected {n}")
        if at is None:
            return decoded.view(-1), None
        dense = torch.zeros(size, dtype=dtype, device=part.device)
        dense[at[0]] = decoded.view(-1).to(dtype)
        return dense, None

    def entries(
        self, part: torch.Tensor, n: int, blocks: Sequence[int], word: int, ramp: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A received payload sized by its count and delta width (:attr:`by_count`) of ``n``
        entries in ``blocks``: the positions and (fp32) values it carries, and its check (:meth:`decode`'s)."""
        return self.codec.known_entries(part, n, blocks, word >> 6, (word & 63) + 1, ramp)

    def add(
        self,
        total: torch.Tensor,
        part: torch.Tensor,
        blocks: Sequence[int],
        word: int,
        ramp: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Add a received payload of ``total.numel()`` entries in ``blocks``, sized by ``word``, to
        ``total``; its check as :meth:`decode`'s. The same bits as adding its dense decode where
        no entry of ``total`` is -0.0 (a sum that starts from zeros: adding 0.0 changes nothing)."""
        if not self.by_count:
            dense, ok = self.decode(part, total.numel(), total.dtype, blocks, word)
            total.add_(dense)
            return ok
        idx, values, ok = self.codec.known_entries(part, total.numel(), blocks, word >> 6, (word & 63) + 1, ramp)
        total.index_add_(0, idx, values.to(total.dtype))
        return ok


@dataclass(frozen=True)
class Segments:
    """Each rank's segment of a bucket (:func:`segments`)."""

    index: list[torch.Tensor]  # per rank: its positions in the bucket, in bucket order
    widths: list[list[int]]  # per rank: the width of its piece of each parameter (0: fewer entries than ranks)
    perm: torch.Tensor  # every rank's positions, rank by rank
    starts: list[int]  # where each rank's positions start in ``perm`` (and the end)
    zero: torch.Tensor  # a 0-d int64 zero: the word of a payload to oneself

    def blocks(self, r: int) -> list[int]:
        """Rank ``r``'s non-empty pieces' widths."""
        return [w for w in self.widths[r] if w]

    def of(self, permuted: torch.Tensor, r: int) -> torch.Tensor:
        """Rank ``r``'s segment of a bucket-sized tensor permuted by ``perm`` (a view)."""
        return permuted[self.starts[r] : self.starts[r + 1]]


def segments(numels: list[int], ws: int, device: torch.device) -> Segments:
    """Each rank's segment of a bucket of parameters of ``numels`` entries: the r-th of W
    contiguous pieces of every parameter, as its positions in the bucket (in bucket order) and
    the width of each piece (0 where a parameter has fewer entries than ranks)."""
    index, widths = [], []
    for r in range(ws):
        bounds, at = [], 0
        for n in numels:
            bounds.append((at + n * r // ws, at + n * (r + 1) // ws))
            at += n
        index.append(torch.cat([torch.arange(lo, hi, device=device) for lo, hi in bounds]))
        widths.append([hi - lo for lo, hi in bounds])
    starts = [0]
    for i in index:
        starts.append(starts[-1] + i.numel())
    zero = torch.zeros((), dtype=torch.int64, device=device)
    return Segments(index, widths, torch.cat(index), starts, zero)


def _made(payload: torch.Tensor | None) -> torch.Tensor:
    assert payload is not None, "a payload sized by its length is coded before its word"
    return payload
