"""Encoder stage: non-negative int32 codes -> bytes, fixed-length blocks or byte planes + zstd.

Both coders are lossless over [0, 2**31); the decoder is told how many codes to expect.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch
import zstandard

from . import reference
from .format import PayloadError, view_as

FIXED, ZSTD = 0, 1


class Coder(Protocol):
    """codes -> section bytes -> codes; and which of a section's bytes code which segment."""

    kind: int

    def encode(self, codes: torch.Tensor) -> torch.Tensor: ...

    def decode(self, section: torch.Tensor, n: int, what: str, checked: bool = False) -> torch.Tensor: ...

    def shares(self, section: torch.Tensor, n: int, ends: torch.Tensor) -> torch.Tensor: ...


def group_shares(widths: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The fixed-length coder's bytes of each segment of the codes (segment ``b`` ends before
    code ``ends[b]``, int64 on the device): per group of 32 codes its width byte and its words,
    counted in the segment where the group starts (float64, one op per step, no loop)."""
    starts = torch.arange(widths.numel(), device=widths.device) * reference.GROUP
    segment = torch.bucketize(starts, ends, right=True).clamp_(max=max(ends.numel() - 1, 0))
    out = torch.zeros(ends.numel(), dtype=torch.float64, device=widths.device)
    return out.index_add_(0, segment, 1.0 + 4.0 * widths.double())


class BlockCoder:
    """cuSZp-style: groups of 32 codes, one width byte per group, then the packed words.

    Section: uint8 widths [ceil(n/32)] | zero pad to 4 bytes | int32 words [sum(widths)].
    """

    kind = FIXED

    def __init__(self, backend=reference):
        self.backend = backend

    def encode(self, codes: torch.Tensor) -> torch.Tensor:
        """Pack ``codes`` (non-negative int32)."""
        widths, words = self.backend.block_pack(codes)
        pad = torch.zeros(-widths.numel() % 4, dtype=torch.uint8, device=codes.device)
        return torch.cat([widths, pad, words.view(torch.uint8)])

    def encode_capacity(self, codes: torch.Tensor, n: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor | int]]:
        """:meth:`encode` of the first ``n`` (an int64 0-d tensor) of ``codes`` (zeros after), as
        pieces with their lengths on the device: no host wait."""
        widths, words = self.backend.block_pack(codes, capacity=True)
        g = (n + reference.GROUP - 1) // reference.GROUP
        pad = torch.zeros(4, dtype=torch.uint8, device=codes.device)
        total = widths.long().sum()  # groups past the n-th code have width 0
        return [(widths, g), (pad, (-g).remainder(4)), (words.view(torch.uint8), 4 * total)]

    def shares(self, section: torch.Tensor, n: int, ends: torch.Tensor) -> torch.Tensor:
        """The bytes of ``section`` (``n`` codes) that code each segment of them
        (:func:`group_shares`), read from its group widths on the device; its padding to 4 bytes
        is no segment's."""
        return group_shares(section[: -(-n // reference.GROUP)], ends)

    def decode(self, section: torch.Tensor, n: int, what: str, checked: bool = False) -> torch.Tensor:
        """Unpack ``n`` codes, checking that the section has exactly the bytes they need;
        ``checked``: the payload's check passed already, so nothing is read back (no host wait)."""
        g = -(-n // reference.GROUP)
        head = g + (-g % 4)
        if section.numel() < head:
            raise PayloadError(f"{what}: {section.numel()} bytes cannot hold {g} group widths")
        widths = section[:g]
        if checked:  # nothing read back: widths that disagree with the words (an encoder bug or a
            # forged check) decode as zero-width groups rather than read past the words
            words = view_as(section[head:], torch.int32, what)
            w = widths.clamp(max=31)
            w = w * (w.long().sum() == words.numel())
            return self.backend.block_unpack(w, words, n)
        top, total = torch.stack([widths.max(), widths.sum()]).tolist() if g else (0, 0)  # one host read
        if top > 31:
            raise PayloadError(f"{what}: group width {top} > 31")
        need = total * 4
        if section.numel() - head != need:
            raise PayloadError(f"{what}: {section.numel() - head} bytes of packed words, widths say {need}")
        words = view_as(section[head:], torch.int32, what)
        return self.backend.block_unpack(widths, words, n)


class ZstdCoder:
    """Near-entropy: the codes' significant bytes as planes (low byte first), then one zstd frame.

    Section: u8 number of planes (0..4) | zstd frame of ``planes * n`` bytes (absent if 0 planes).
    Runs on the host; device tensors are copied.
    """

    kind = ZSTD

    def __init__(self, level: int = 1):
        self.level = level
        self._local = threading.local()  # zstd contexts are not thread-safe: one pair per thread

    def __getstate__(self) -> dict:
        """The level alone: the contexts belong to a thread, and are made again where needed (so
        that a sharder holding this coder can be handed to other processes)."""
        return {"level": self.level}

    def __setstate__(self, state: dict) -> None:
        self.level = state["level"]
        self._local = threading.local()

    @property
    def _cctx(self) -> zstandard.ZstdCompressor:
        if not hasattr(self._local, "cctx"):
            self._local.cctx = zstandard.ZstdCompressor(level=self.level)
        return self._local.cctx

    @property
    def _dctx(self) -> zstandard.ZstdDecompressor:
        if not hasattr(self._local, "dctx"):
            self._local.dctx = zstandard.ZstdDecompressor()
        return self._local.dctx

    def encode(self, codes: torch.Tensor) -> torch.Tensor:
        """Byte-plane ``codes`` (non-negative int32) and zstd them."""
        device = codes.device
        codes = codes.cpu()
        top = int(codes.max()) if codes.numel() else 0
        planes = (top.bit_length() + 7) // 8
        if planes == 0:
            return torch.zeros(1, dtype=torch.uint8, device=device)
        raw = codes.to(torch.uint8) if planes == 1 else codes.view(torch.uint8).view(-1, 4)[:, :planes].t().contiguous()
        frame = self._cctx.compress(raw.numpy())  # type: ignore[arg-type]  # any buffer; stubs: bytes
        out = torch.empty(1 + len(frame), dtype=torch.uint8)
        out[0] = planes
        out[1:] = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
        return out.to(device)

    def shares(self, section: torch.Tensor, n: int, ends: torch.Tensor) -> torch.Tensor:
        """``section`` (``n`` codes in one frame, which no byte of splits by segment) shared in
        proportion to what the fixed-length coder would spend on each segment's codes
        (:func:`group_shares`): the codes decoded on the host, as this coder always is."""
        if n == 0:
            return torch.zeros(ends.numel(), dtype=torch.float64, device=section.device)
        codes = self.decode(section, n, "codes")
        g = -(-n // reference.GROUP)
        padded = torch.cat([codes, codes.new_zeros(g * reference.GROUP - n)]).view(g, reference.GROUP)
        fixed = group_shares(reference.bit_length(padded.amax(dim=1)), ends)
        return fixed * (section.numel() / fixed.sum())

    def decode(self, section: torch.Tensor, n: int, what: str, checked: bool = False) -> torch.Tensor:
        """Decompress ``n`` codes; the frame must hold exactly ``planes * n`` bytes (read on the
        host whatever ``checked`` says)."""
        if section.numel() < 1:
            raise PayloadError(f"{what}: empty section")
        host = section.cpu()
        planes = int(host[0])
        if planes > 4:
            raise PayloadError(f"{what}: {planes} byte planes (at most 4)")
        if planes == 0:
            if section.numel() != 1:
                raise PayloadError(f"{what}: all-zero codes with {section.numel() - 1} trailing bytes")
            return torch.zeros(n, dtype=torch.int32, device=section.device)
        try:
            raw = self._dctx.decompress(host[1:].numpy(), max_output_size=planes * n)  # type: ignore[arg-type]  # as above
        except zstandard.ZstdError as e:
            raise PayloadError(f"{what}: zstd frame does not decode ({e})") from None
        if len(raw) != planes * n:
            raise PayloadError(f"{what}: zstd frame holds {len(raw)} bytes, expected {planes * n}")
        b = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if planes == 1:
            out = b.to(torch.int32)
        else:
            full = torch.zeros(n, 4, dtype=torch.uint8)
            full[:, :planes] = b.view(planes, n).t()
            out = full.view(torch.int32).view(-1)
        if planes == 4 and n and int(out.min()) < 0:  # only a 4th plane can set the sign bit
            raise PayloadError(f"{what}: negative code")
        return out.to(section.device)
