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
from dlrm_compression.sparse import Threshold, ThresholdCodec, delta_width


@dataclass(frozen=True)
class Coding:
    """DCT's codec on one device: :attr:`by_count` says which word sizes a payload."""

    codec: ThresholdCodec
    by_count: bool  # the word is the count and delta width (else the payload's length)

    @staticmethod
    def of(codec: ThresholdCodec, device: torch.device) -> Coding:
        return Coding(codec, codec.values != "lossy" and not codec.coded_on_host(device))

    def mask(self, x: torch.Tensor, blocks: Sequence[int], thresholds: Sequence[Threshold]) -> torch.Tensor:
        """Which entries of ``x`` (flat, in ``blocks``) travel: ``|x| >=`` their block's threshold, or NaN."""
        return self.codec.mask(x.view(1, -1), blocks, thresholds).view(-1)

    def sent(self, x: torch.Tensor, keep: torch.Tensor, payload: torch.Tensor | None) -> torch.Tensor:
        """What every receiver decodes of this rank's selection ``keep`` of ``x``: decoded from
        ``payload`` where it is coded first (lossy values are known from it alone; so the host
        coding's NaNs keep the bits its decode gives them), computed from ``x`` otherwise."""
        if not self.by_count:
            return self.codec.decode(_made(payload)).view(-1)
        return self.codec.sent(x, keep)

    def first(
        self,
        x: torch.Tensor,
        keep: torch.Tensor,
        blocks: Sequence[int],
        thresholds: Sequence[Threshold],
        eb: float | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The word of this rank's payload of ``x`` where ``keep`` is set (a 0-d int64 tensor on
        ``x``'s device), and the payload where it must be coded before its size is known."""
        if self.by_count:
            return keep.sum() * 64 + delta_width(keep) - 1, None  # count and delta width (1..64)
        payload = self.codec.encode(x.view(1, -1), eb, blocks=blocks, thresholds=thresholds)
        return torch.tensor(payload.numel(), dtype=torch.int64, device=x.device), payload

    def size(self, n: int, blocks: Sequence[int], word: int) -> int:
        """Bytes of a payload of ``n`` entries in ``blocks`` sized by ``word``."""
        return self.codec.payload_size(n, blocks, word >> 6, (word & 63) + 1) if self.by_count else word

    def count(self, word: int, payload: torch.Tensor | None) -> int:
        """How many entries this rank's payload (sized by ``word``) carries."""
        return word >> 6 if self.by_count else self.codec.count(_made(payload))

    def encoded(
        self, x: torch.Tensor, keep: torch.Tensor, blocks: Sequence[int], word: int, payload: torch.Tensor | None
    ) -> torch.Tensor:
        """This rank's payload of ``x`` where ``keep`` is set, once ``word`` is read (or as made first)."""
        if not self.by_count:
            return _made(payload)
        return self.codec.encode_known(x.view(1, -1), keep, word >> 6, (word & 63) + 1, blocks)

    def decode(
        self, part: torch.Tensor, n: int, dtype: torch.dtype, blocks: Sequence[int], word: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A received payload of ``n`` entries in ``blocks``, sized by ``word``: its values (flat),
        and its check as a 0-d bool tensor still to be read (None: checked already)."""
        if self.by_count:
            dense, ok = self.codec.decode_known(part, (1, n), dtype, blocks, word >> 6, (word & 63) + 1)
            return dense.view(-1), ok
        decoded = compression.decode(part)
        if decoded.numel() != n:
            raise PayloadError(f"{decoded.numel()} gradients, expected {n}")
        return decoded.view(-1), None


def segments(numels: list[int], ws: int, device: torch.device) -> list[tuple[torch.Tensor, list[int]]]:
    """Each rank's segment of a bucket of parameters of ``numels`` entries: the r-th of W
    contiguous pieces of every parameter, as its positions in the bucket (in bucket order) and
    the width of each piece (0 where a parameter has fewer entries than ranks)."""
    out = []
    for r in range(ws):
        starts, ends, widths = [], [], []
        at = 0
        for n in numels:
            lo, hi = at + n * r // ws, at + n * (r + 1) // ws
            starts.append(lo)
            ends.append(hi)
            widths.append(hi - lo)
            at += n
        index = torch.cat([torch.arange(lo, hi, device=device) for lo, hi in zip(starts, ends, strict=True)])
        out.append((index, widths))
    return out


def _made(payload: torch.Tensor | None) -> torch.Tensor:
    assert payload is not None, "a payload sized by its length is coded before its word"
    return payload
