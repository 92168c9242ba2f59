"""The codec interface, the registry behind ``get_codec``, and the shared input checks."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, overload

import torch

from . import format as fmt
from .backend import CHOICES, Backend, backend_for, upload
from .format import PayloadError

Bound = float | Sequence[float] | torch.Tensor

_REGISTRY: dict[str, type[Codec]] = {}
_BY_ID: dict[int, type[Codec]] = {}


def register(cls: type[Codec]) -> type[Codec]:
    """Class decorator: make a codec reachable by ``get_codec(cls.name)`` and by its payload id."""
    if cls.name in _REGISTRY or cls.codec_id in _BY_ID:
        raise ValueError(f"codec name {cls.name!r} or id {cls.codec_id} registered twice")
    _REGISTRY[cls.name] = cls
    _BY_ID[cls.codec_id] = cls
    return cls


def get_codec(name: str, backend: str = "auto", **params) -> Codec:
    """Build the codec registered as ``name`` with its keyword parameters; ``backend``: where its
    stages run (:func:`compression.backend.backend_for`'s choice: auto, host or device)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown codec {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    try:
        codec = _REGISTRY[name](**params)
    except TypeError as e:  # name the codec: "unexpected keyword" alone does not say which
        raise TypeError(f"codec {name!r}: {e}") from None
    return codec.with_backend(backend)


def available_codecs() -> list[str]:
    """Names accepted by :func:`get_codec`."""
    return sorted(_REGISTRY)


def is_bounded(name: str) -> bool:
    """Whether the codec registered as ``name`` guarantees an error bound (reads ``eb``)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown codec {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    return bool(_REGISTRY[name].bounded)


def codec_for(payload: torch.Tensor, head: fmt.HostHead | None = None) -> Codec:
    """The (default-parameter) codec that wrote ``payload``; decoding needs no parameters (and
    checks the whole payload: here only its prefix is read, or taken from ``head``)."""
    codec_id = fmt.peek_codec_id(payload, head)
    if codec_id not in _BY_ID:
        raise PayloadError(f"payload written by unknown codec id {codec_id}")
    return _BY_ID[codec_id]()


def decode(payload: torch.Tensor, ids: torch.Tensor | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode any payload with the codec named in its header."""
    return codec_for(payload).decode(payload, ids, out=out)


@dataclass
class CodecContext:
    """What one call of a collective tells a codec besides its tensor (TorchRec's codec context is
    the model): each codec reads what concerns it and ignores the rest."""

    single: torch.Tensor | None = None  # a 0-d bool on the device: whether the ids hold (not read yet)
    summed: bool = False  # each id's rows travel as their sum (a gradient's), where the codec can
    keep_first: bool = False  # decoded, each id's value stays on its first row only (zeros elsewhere)
    thresholds: Sequence[Any] | None = None  # DCT-MP: each block's threshold
    choice: Sequence[str | None] | None = None  # compression=auto: each block's option (None: the fallback)


NO_CONTEXT = CodecContext()


@dataclass
class Unpacked:
    """A payload as :meth:`Codec.decode` hands it to its codec: unpacked, written by that codec."""

    header: fmt.Header
    sections: list[torch.Tensor]  # views of the payload
    head: fmt.HostHead | None  # its head and prepare_decode's values, read already (None: read as needed)
    device: torch.device


class Codec(ABC):
    """tensor [rows, cols] -> self-describing uint8 payload -> tensor.

    ``bounded`` codecs guarantee ``|decode(encode(x, eb)) - x| <= eb`` element-wise; the others
    ignore ``eb`` (cast/quantised baselines).

    The transport calls the protocol below, whose defaults fit a codec that reads what it needs
    on the host: :meth:`encode_deferred` (a payload whose length may stay on the device),
    :meth:`defers` and :meth:`chooses_ids_on_device` (what it can do there), :meth:`head_size`
    and :meth:`prepare_decode` (what its decoder reads on the host, with every payload of the
    collective at once) and :meth:`decode` with that ``head``; each takes a
    :class:`CodecContext`.

    :meth:`encode`, :meth:`encode_deferred` and :meth:`decode` are this class's, so that every
    codec takes the same arguments and rejects bad ones alike: they check the input, its block
    widths and ids, or the payload's header, writer and ``out``, then call the codec's hooks
    :meth:`_encode`, :meth:`_encode_deferred` and :meth:`_decode`.
    """

    name: ClassVar[str]
    codec_id: ClassVar[int]
    bounded: ClassVar[bool] = False
    # Whether ``eb`` and ``ids`` are per block: they split the columns where ``blocks`` is not
    # given, and encode checks them. False for a codec that takes one bound for all its values
    # and no ids (threshold).
    per_block_args: ClassVar[bool] = True
    backend_choice: str = "auto"  # where its stages run (with_backend); a codec's own, not shared

    def with_backend(self, choice: str) -> Codec:
        """Run this codec's stages on the ``choice`` backend (auto, host or device) from now on;
        returns the codec. Codecs that hold others pass it on."""
        if choice not in CHOICES:
            raise ValueError(f"backend must be one of {CHOICES}, got {choice!r}")
        self.backend_choice = choice
        return self

    def backend_for(self, device: torch.device) -> Backend:
        """The backend of this codec's stages on ``device``, chosen once per call from the device."""
        return backend_for(device, self.backend_choice)

    def encode(
        self,
        x: torch.Tensor,
        eb: Bound | None = None,
        ids: torch.Tensor | None = None,
        *,
        blocks: Sequence[int] | None = None,
        context: CodecContext = NO_CONTEXT,
    ) -> torch.Tensor:
        """Compress ``x`` into one payload (see the package docstring for ``eb``/``ids``/``blocks``)."""
        widths, keys = self._checked(x, eb, ids, blocks)
        return self._encode(x, widths, eb, keys, context)

    def decode(
        self,
        payload: torch.Tensor,
        ids: torch.Tensor | None = None,
        *,
        out: torch.Tensor | None = None,
        head: fmt.HostHead | None = None,
        context: CodecContext = NO_CONTEXT,
    ) -> torch.Tensor:
        """Rebuild the tensor (shape, dtype, device of the payload) from a payload.

        ``out``: write into this tensor instead (the payload's shape, dtype and device; it may be
        a strided view, e.g. one peer's columns of an all-to-all's output) and return it. Reusing
        or sharing the output saves the allocation (page faults on CPU) and the caller's copy.
        ``head``: the payload's head and :meth:`prepare_decode`'s values, read already
        (:func:`compression.format.read_heads`), so that the decode need not wait for the device.
        """
        writer, head = self._writer(payload, head)
        if writer is not self:
            return writer.decode(payload, ids, out=out, head=head)
        header, sections = self._header(payload, head)
        check_out(out, header, payload.device)
        return self._decode(Unpacked(header, sections, head, payload.device), ids, out, context)

    # -- what each codec implements -------------------------------------------------------------

    @abstractmethod
    def _encode(
        self, x: torch.Tensor, widths: list[int], eb: Bound | None, ids: torch.Tensor | None, context: CodecContext
    ) -> torch.Tensor:
        """:meth:`encode` of ``x`` checked, in blocks of ``widths``; ``eb`` as given (a bounded
        codec resolves it, an unbounded one's was checked); ``ids`` checked, as int64
        [rows, n_blocks] (None for a codec that takes none)."""

    def _encode_deferred(
        self, x: torch.Tensor, widths: list[int], eb: Bound | None, ids: torch.Tensor | None, context: CodecContext
    ) -> torch.Tensor | fmt.Deferred | None:
        """:meth:`encode_deferred`'s payload where this codec builds it on ``x``'s device as
        :meth:`_encode` is given it; None: this call takes :meth:`_encode`'s path (default)."""
        return None

    @abstractmethod
    def _decode(
        self, payload: Unpacked, ids: torch.Tensor | None, out: torch.Tensor | None, context: CodecContext
    ) -> torch.Tensor:
        """:meth:`decode` of a payload this codec wrote, unpacked (``out`` checked already)."""

    def _writer(self, payload: torch.Tensor, head: fmt.HostHead | None) -> tuple[Codec, fmt.HostHead | None]:
        """The codec that decodes ``payload`` and the head it takes: this one; a codec whose
        payloads may be another's overrides it."""
        return self, head

    def _checked(
        self, x: torch.Tensor, eb: Bound | None, ids: torch.Tensor | None, blocks: Sequence[int] | None
    ) -> tuple[list[int], torch.Tensor | None]:
        """Every encode's prologue: ``x`` checked, the block widths, ``eb`` checked where this
        codec ignores it, and the ids checked as int64 [rows, n_blocks]."""
        check_input(x)
        if not self.per_block_args:
            return resolve_blocks(x.shape[1], None, None, blocks), None
        widths = resolve_blocks(x.shape[1], eb, ids, blocks)
        if not self.bounded:
            resolve_bounds(eb, widths, required=False)  # malformed bounds are rejected even though unused
        return widths, check_ids(ids, x.shape[0], len(widths), f"codec {self.name!r} encode")

    # -- the transport's protocol (defaults: read on the host as needed) ------------------------

    def defers(self, device: torch.device) -> bool:
        """Whether :meth:`encode_deferred` builds payloads on ``device`` without a host wait."""
        return False

    def chooses_ids_on_device(self, device: torch.device) -> bool:
        """Whether :meth:`encode_deferred` takes ``context.single`` (whether the ids hold, unread)
        and chooses between ids and rows on the device (else it reads the flag)."""
        return False

    def sums_duplicates(self, device: torch.device) -> bool:
        """Whether :meth:`encode_deferred` takes ``context.summed`` (each id's rows sent as their
        sum) and :meth:`decode` (and, where :meth:`checks_in_decode`, :meth:`decode_checked`)
        ``context.keep_first`` on ``device`` (else the caller sums and keeps)."""
        return False

    def encode_deferred(
        self,
        x: torch.Tensor,
        eb: Bound | None = None,
        ids: torch.Tensor | None = None,
        *,
        blocks: Sequence[int] | None = None,
        context: CodecContext = NO_CONTEXT,
    ) -> torch.Tensor | fmt.Deferred:
        """:meth:`encode`, with the payload's length left on the device where the codec can
        (:class:`compression.format.Deferred`, read with every length of the collective at once).
        Elsewhere :meth:`encode`'s payload, after reading whether the ids hold (``context.single``)."""
        widths, keys = self._checked(x, eb, ids, blocks)
        deferred = self._encode_deferred(x, widths, eb, keys, context)
        return (
            deferred if deferred is not None else self._encode(x, widths, eb, held_ids(keys, context.single), context)
        )

    def checks_in_decode(self, device: torch.device) -> bool:
        """Whether the decoder needs nothing from the host (the header its receiver expects is
        known) and checks the payload as it decodes it (:meth:`decode_checked`), its verdict read
        with the collective's others after every decode; else its head is read before."""
        return False

    def decode_checked(
        self,
        payload: torch.Tensor,
        out: torch.Tensor,
        blocks: Sequence[int],
        context: CodecContext = NO_CONTEXT,
        *,
        ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Where :meth:`checks_in_decode`: the payload decoded into ``out`` (the shape and dtype
        the receiver expects, ``blocks`` its block widths) and its verdict, an int64 tensor on the
        device, all ones where the payload is sound (the values written are then to be used).
        ``ids``: the rows' ids, read where ``context.keep_first`` (:meth:`sums_duplicates`)."""
        raise NotImplementedError(f"codec {self.name!r} reads its head before it decodes")

    def head_size(self, n_blocks: int) -> int | None:
        """Bytes of a payload of ``n_blocks`` blocks its decoder needs on the host, read with the
        collective's heads where :meth:`prepare_decode` says so; None: it reads for itself."""
        return None

    def prepare_decode(
        self, payload: torch.Tensor, ids: torch.Tensor | None, context: CodecContext = NO_CONTEXT
    ) -> tuple[torch.Tensor | None, Any] | None:
        """Where :meth:`decode` can take everything it reads on the host from the collective's one
        read (:func:`compression.format.read_heads`): the device values to read with the payload's
        head (int64, or None) and the state that goes with them; None: it reads for itself."""
        return None

    def known_size(self, shape: tuple[int, int], dtype: torch.dtype, blocks: Sequence[int]) -> int | None:
        """The bytes of the payload of a ``shape`` chunk of ``dtype`` in column ``blocks``, where
        the host knows them before encoding (TorchRec's ``calc_quantized_size``: a fixed-rate
        codec's); None: known once encoded."""
        return None

    def block_bytes(
        self, payload: torch.Tensor, blocks: Sequence[int], head: fmt.HostHead | None = None
    ) -> torch.Tensor:
        """Each block's share of ``payload``'s bytes (float64 on the payload's device, summing to
        its length), from what the payload's sections say of each block: a codec that can tell
        which of its bytes code which block counts them, and splits the rest (the header,
        padding, what it codes jointly) in proportion to the blocks' widths (``blocks``, as
        encoded). Default: all of it in proportion to the widths (a cast's values are each
        block's rows at one width). ``head``: the payload's head, read already
        (:func:`compression.format.read_heads`), so that nothing here waits for the device."""
        return by_width(payload.numel(), blocks, payload.device)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    # -- shared helpers -------------------------------------------------------------------------

    def _header(self, payload: torch.Tensor, head: fmt.HostHead | None = None) -> tuple[fmt.Header, list[torch.Tensor]]:
        """Unpack (from its ``head`` if read already) and check that this codec wrote the payload."""
        header, sections = fmt.unpack(payload, head, self.backend_for(payload.device))
        if header.codec_id != self.codec_id:
            other = _BY_ID.get(header.codec_id)
            raise PayloadError(
                f"payload was written by codec {other.name if other else header.codec_id!r}, not {self.name!r}"
            )
        return header, sections


def by_width(total: float | torch.Tensor, widths: Sequence[int], device: torch.device) -> torch.Tensor:
    """``total`` bytes (a number, or a 0-d tensor on ``device``) split over blocks in proportion to
    their ``widths``, as float64 on ``device`` (nothing read; zeros where every width is 0)."""
    w = upload(torch.tensor(list(widths), dtype=torch.float64), device)
    return w * (total / max(sum(widths), 1))


def check_out(out: torch.Tensor | None, header: fmt.Header, device: torch.device) -> None:
    """Reject an ``out=`` tensor that cannot hold the payload's tensor (a caller error, not a
    payload error)."""
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    want = (header.rows, header.cols)
    if tuple(out.shape) != want or out.dtype != header.dtype or out.device != device:
        raise ValueError(
            f"out is {tuple(out.shape)} {out.dtype} on {out.device}; the payload holds "
            f"{list(want)} {header.dtype} on {device}"
        )


def into(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``result``, or ``out`` after copying (and casting) ``result`` into it."""
    return result if out is None else out.copy_(result)


def check_input(x: torch.Tensor) -> None:
    """Reject anything but a 2-D float32/float16/bfloat16 tensor, naming what was given."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [rows, cols], got shape {tuple(x.shape)}")
    if x.dtype not in fmt.DTYPES:
        raise ValueError(f"x dtype {x.dtype} not supported; use one of {list(fmt.DTYPES)}")


def resolve_blocks(cols: int, eb: Bound | None, ids: torch.Tensor | None, blocks: Sequence[int] | None) -> list[int]:
    """Column widths of the blocks (tables): ``blocks`` if given, else an equal split into as many
    blocks as ``eb`` has bounds or ``ids`` has columns, else one block."""
    if blocks is not None:
        widths = [int(b) for b in blocks]
        if any(w < 0 for w in widths) or sum(widths) != cols:
            raise ValueError(f"blocks={widths} must be non-negative widths summing to cols={cols}")
        return widths
    n = 1
    if eb is not None and not isinstance(eb, (int, float)) and not (isinstance(eb, torch.Tensor) and eb.dim() == 0):
        n = len(eb)
    elif ids is not None and ids.dim() == 2:
        n = ids.shape[1]
    if n == 1:
        return [cols]
    if n == 0 or cols % n:
        raise ValueError(f"cannot split {cols} columns into {n} equal blocks; pass blocks=[...]")
    return [cols // n] * n


def resolve_bounds(eb: Bound | None, widths: list[int], required: bool) -> list[float]:
    """One absolute bound per block as Python floats; ``inf`` marks an unbounded codec."""
    if eb is None:
        if required:
            raise ValueError("this codec needs an error bound eb (a float or one per block)")
        return [math.inf] * len(widths)
    if isinstance(eb, torch.Tensor):
        eb = eb.detach().cpu().double().reshape(-1).tolist() if eb.dim() else float(eb)
    bounds = [float(eb)] * len(widths) if isinstance(eb, (int, float)) else [float(e) for e in eb]
    if len(bounds) != len(widths):
        raise ValueError(f"{len(bounds)} error bounds for {len(widths)} blocks {widths}")
    if required:
        bad = [i for i, e in enumerate(bounds) if not (e >= 0 and math.isfinite(e))]
        if bad:
            raise ValueError(f"error bound of block {bad[0]} is {bounds[bad[0]]}: must be finite and >= 0")
    return bounds


def on_device(eb: Bound | None, backend: Backend) -> bool:
    """Whether the bounds take the device path: a tensor, unless ``backend`` reads a CPU one on
    the host."""
    return isinstance(eb, torch.Tensor) and not (backend.host_bounds and eb.device.type == "cpu")


def device_bounds(eb: torch.Tensor, widths: list[int], device: torch.device) -> torch.Tensor:
    """One absolute bound per block as a float64 tensor on ``device``, without a host wait: a
    device tensor of bounds (e.g. :func:`compression.relative_to_absolute`'s) stays there, and
    is checked there by an asynchronous assert (finite and >= 0)."""
    b = eb.detach().to(device=device, dtype=torch.float64).reshape(-1)
    if b.numel() == 1 and len(widths) != 1:
        b = b.expand(len(widths))
    if b.numel() != len(widths):
        raise ValueError(f"{b.numel()} error bounds for {len(widths)} blocks {widths}")
    ok = (b.nan_to_num(-1.0, -1.0, -1.0) >= 0).all()  # (NaN and inf fail too)
    torch._assert_async(ok, "error bounds must be finite and >= 0")
    return b


def block_bounds(
    eb: Bound | None, widths: list[int], device: torch.device, backend: Backend
) -> list[float] | torch.Tensor:
    """A bounded codec's per-block bounds: a tensor of bounds stays on its device, unread
    (:func:`device_bounds`); host numbers are checked on the host (:func:`resolve_bounds`)."""
    if isinstance(eb, torch.Tensor) and on_device(eb, backend):
        return device_bounds(eb, widths, device)
    return resolve_bounds(eb, widths, required=True)


def held_ids(ids: torch.Tensor | None, single: torch.Tensor | None) -> torch.Tensor | None:
    """``ids`` where they hold, as ``single`` says (a 0-d bool on the device, read here: a host
    wait, for the paths that cannot choose between ids and rows on the device); no ``single``:
    they do."""
    return ids if ids is None or single is None or bool(single) else None  # (no ids: nothing to read)


@overload
def check_ids(ids: torch.Tensor, rows: int, n_blocks: int, where: str) -> torch.Tensor: ...
@overload
def check_ids(ids: None, rows: int, n_blocks: int, where: str) -> None: ...
@overload
def check_ids(ids: torch.Tensor | None, rows: int, n_blocks: int, where: str) -> torch.Tensor | None: ...
def check_ids(ids: torch.Tensor | None, rows: int, n_blocks: int, where: str) -> torch.Tensor | None:
    """Validate ``ids`` ([rows] or [rows, n_blocks] integers) and return them as int64 [rows, n_blocks]."""
    if ids is None:
        return None
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(
            f"{where}: ids must be an integer tensor, got "
            f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__}"
        )
    if ids.dim() == 1 and ids.shape[0] == rows:
        return ids.long()[:, None].expand(rows, n_blocks)
    if ids.dim() == 2 and tuple(ids.shape) == (rows, n_blocks):
        return ids.long()
    raise ValueError(f"{where}: ids shape {tuple(ids.shape)} must be [{rows}] or [{rows}, {n_blocks}]")
