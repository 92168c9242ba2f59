"""One payload, a codec per column block: each table of a chunk travels with the codec chosen for it.

:class:`PerBlockCodec` groups the blocks by their codec, encodes each group (its columns gathered
into one tensor) with that codec, and packs the group payloads as the sections of one payload; a
first section records which group every block is in. Decoding needs no parameters: every group
payload names its own codec. A chunk whose blocks all use one codec travels as that codec's own
payload (no second header, copy or checksum: the common case once a strategy is chosen).

Bounds: a block's ``eb`` is honoured by every choice. A bounded codec (``lossy``) holds it by
construction; a cast or fixed-rate codec is used for a block only if its worst-case error on that
block (:func:`worst_case_error`: half a unit in the last place of the block's largest magnitude
for fp16/bf16, half a quantisation step of its range for int8) is within ``eb``; otherwise the
block goes to the ``fallback`` (bounded) option instead. So a choice can never loosen the bound.

On a device (:meth:`PerBlockCodec.encode_deferred`) that verdict stays on the device: the groups
follow the choice alone, the fallback's group also carries every block that might fall back, and
sections 1 and 2 say which blocks each group carries and hold a copy of each group payload's head,
so that a receiver reads everything it needs with the payload's first bytes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from . import format as fmt
from .backend import upload
from .base import (
    NO_CONTEXT,
    Bound,
    Codec,
    CodecContext,
    Unpacked,
    block_bounds,
    by_width,
    check_ids,
    codec_for,
    get_codec,
    register,
    resolve_bounds,
)
from .format import PayloadError

# The options by name: a codec of this package and its parameters.
OPTIONS: dict[str, tuple[str, dict]] = {
    "none": ("none", {}),
    "fp16": ("fp16", {}),
    "bf16": ("bf16", {}),
    "int8": ("int8", {"row_dim": 32}),
    "lossy/fixed": ("lossy", {"entropy": False}),
    # entropy-coded where that stays cheap: zstd on CPU tensors; on a device (where zstd would copy
    # every payload to the host) the fixed-length coder, as the lossy codec's entropy=auto
    "lossy/zstd": ("lossy", {"entropy": "auto"}),
}

# Worst-case absolute error of the unbounded options, as (relative to the largest |x|, absolute
# floor from subnormals) for the casts, and per range for int8 (fbgemm's row-wise uint8 over
# chunks: half of a step of (max - min) / 255 of a chunk, at most of the block).
_CAST = {"none": (0.0, 0.0), "fp16": (2.0**-11, 2.0**-25), "bf16": (2.0**-8, 2.0**-134)}
_FP16_MAX = 65504.0


def worst_case_error(option: str, block: torch.Tensor) -> float:
    """The largest error ``option`` can make on ``block`` (inf where it could lose a non-finite
    value or overflow, so that such a block goes to the bounded fallback, which keeps them)."""
    if option == "none" or block.numel() == 0:
        return 0.0
    return float(_worst_case(option, block))


def _worst_case(option: str, block: torch.Tensor) -> torch.Tensor:
    """:func:`worst_case_error` of a non-empty block as a float64 0-d tensor on its device (no
    host wait): the same float64 operations, so the same number."""
    lo, hi = (v.double() for v in torch.aminmax(block.detach()))  # NaN and inf propagate
    top = torch.maximum(lo.abs(), hi.abs())
    if option in _CAST:
        rel, floor = _CAST[option]
        err = top * rel + floor
        if option == "fp16":
            err = torch.where(top >= _FP16_MAX, math.inf, err)
    elif option == "int8":
        err = (hi - lo) / 255.0 / 2.0 * (1 + 2.0**-10)  # half a step of the range; fp16 scale rounding
    else:
        raise ValueError(f"no worst-case error for option {option!r}; bounded codecs hold their own bound")
    return torch.where(top.isfinite(), err, math.inf)


@register
class PerBlockCodec(Codec):
    """Each column block with its own codec (``options``: name -> codec), chosen per call."""

    name = "per_block"
    codec_id = 9
    bounded = True

    def __init__(self, options: Sequence[str] | Mapping[str, Codec] = tuple(OPTIONS), fallback: str = "lossy/zstd"):
        if isinstance(options, Mapping):
            self.options = dict(options)
        else:
            unknown = sorted(set(options) - set(OPTIONS))
            if unknown:
                raise ValueError(f"per_block options {unknown} unknown; known: {sorted(OPTIONS)}")
            self.options = {n: get_codec(OPTIONS[n][0], **OPTIONS[n][1]) for n in options}
        self.fallback = fallback
        if fallback not in self.options:
            raise ValueError(f"fallback {fallback!r} is not among the options {sorted(self.options)}")
        if not getattr(self.options[fallback], "bounded", False):
            raise ValueError(f"fallback {fallback!r} must be a bounded codec")

    def with_backend(self, choice: str) -> PerBlockCodec:
        super().with_backend(choice)
        for codec in self.options.values():
            codec.with_backend(choice)
        return self

    def effective(
        self, x: torch.Tensor, widths: Sequence[int], bounds: Sequence[float], choice: Sequence[str]
    ) -> list[str]:
        """The option each block really gets: its choice, or the fallback where that could exceed
        the block's bound."""
        out, c = [], 0
        for w, eb, name in zip(widths, bounds, choice, strict=True):
            codec = self.options[name]
            ok = getattr(codec, "bounded", False) or worst_case_error(name, x[:, c : c + w]) <= eb
            out.append(name if ok else self.fallback)
            c += w
        return out

    def _unsure(self, name: str) -> bool:
        """Whether option ``name`` may exceed a block's bound (decided from the block's values)."""
        return not getattr(self.options[name], "bounded", False) and name != "none"

    def device_groups(self, choice: Sequence[str]) -> tuple[list[str], list[list[int]]]:
        """The device path's groups, fixed by the choice alone (not by the data): each option
        chosen, in first-use order, carrying its blocks; the fallback also carries every block
        whose option may exceed its bound, so that no group's shape waits for the device's
        verdict. Sender and receiver compute the same from the same choice."""
        names = sorted(set(choice), key=list(choice).index)
        unsure = {k for k, name in enumerate(choice) if self._unsure(name)}
        if unsure and self.fallback not in names:
            names.append(self.fallback)
        carried = [
            [k for k, c in enumerate(choice) if c == name or (name == self.fallback and k in unsure)] for name in names
        ]
        return names, carried

    def _checked_choice(self, choice: Sequence[str | None] | None, n_blocks: int) -> list[str]:
        """Each block's option (None, or no choice: the fallback), checked."""
        names = [c or self.fallback for c in choice] if choice is not None else [self.fallback] * n_blocks
        unknown = sorted(set(names) - set(self.options))
        if len(names) != n_blocks or unknown:
            raise ValueError(f"per_block: choice {names} for {n_blocks} blocks; unknown options {unknown}")
        return names

    @staticmethod
    def _columns(x: torch.Tensor, widths: Sequence[int], members: Sequence[int]) -> torch.Tensor:
        """The members' columns of ``x``, in block order (``x`` itself when they are all)."""
        if len(members) == len(widths):
            return x
        starts = [sum(widths[:k]) for k in range(len(widths))]
        cols = torch.cat([torch.arange(starts[k], starts[k] + widths[k]) for k in members])
        return x.index_select(1, cols.to(x.device, non_blocking=True))

    def _encode(
        self, x: torch.Tensor, widths: list[int], eb: Bound | None, ids: torch.Tensor | None, context: CodecContext
    ) -> torch.Tensor:
        """Encode each block with ``context.choice[k]`` (None, or no choice: the fallback)."""
        rows, cols = x.shape
        bounds = resolve_bounds(eb, widths, required=True)
        choice = self._checked_choice(context.choice, len(widths))
        used = self.effective(x, widths, bounds, choice)
        names = sorted(set(used), key=used.index)  # groups in first-use order
        if len(names) == 1:
            return self.options[names[0]].encode(x, bounds, ids, blocks=widths)
        sections = [torch.tensor([names.index(u) for u in used], dtype=torch.uint8)]
        for name in names:
            members = [k for k, u in enumerate(used) if u == name]
            sub = self._columns(x, widths, members)
            sub_ids = ids if ids is None or len(members) == len(widths) else ids[:, members]
            sections.append(
                self.options[name].encode(
                    sub, [bounds[k] for k in members], sub_ids, blocks=[widths[k] for k in members]
                )
            )
        header = fmt.Header(self.codec_id, x.dtype, rows, cols, widths, bounds)
        return fmt.pack(header, sections, device=x.device, backend=self.backend_for(x.device))

    def _encode_deferred(
        self, x: torch.Tensor, widths: list[int], eb: Bound | None, ids: torch.Tensor | None, context: CodecContext
    ) -> torch.Tensor | fmt.Deferred | None:
        """:meth:`encode`'s payload built on the device (Adler-32 check), its length left there:
        made without a host wait where every option builds its own payload so (casts, the
        fixed-length lossy codec); else None (the host path). ``context.single``: a 0-d bool on
        the device saying whether ``ids`` hold (the lossy groups choose on the device,
        :meth:`LossyCodec.encode_deferred`).

        The groups are :meth:`device_groups`'; which option each block really gets (its choice,
        or the fallback where the choice could exceed its bound) is decided on the device and
        written to section 0. A block carried by two groups is decoded from the one section 0
        names; in the fallback's group, the blocks decided otherwise travel as zeros. Section 1
        says which blocks each group carries, section 2 holds a copy of each group payload's
        head (so that one read of the payload's first bytes gives the decoder every header)."""
        if self.backend_for(x.device).reads_sizes:  # the host backend (a CPU): its path is the faster
            return None
        rows, cols = x.shape
        bounds = block_bounds(eb, widths, x.device, self.backend_for(x.device))
        single = context.single
        choice = self._checked_choice(context.choice, len(widths))
        names, carried = self.device_groups(choice)
        if any(self.options[n].head_size(0) is None for n in names):  # an option read on the host
            return None
        if len(names) == 1:
            return self._encode_group(names[0], x, bounds, ids, widths, list(range(len(widths))), single)
        group = self._groups_on_device(x, widths, bounds, choice, names)
        fallback = names.index(self.fallback) if self.fallback in names else -1
        subs: list[torch.Tensor | fmt.Deferred] = []
        for g, (name, members) in enumerate(zip(names, carried, strict=True)):
            sub = self._columns(x, widths, members)
            if g == fallback and any(choice[k] != name for k in members):  # decided otherwise: zeros
                at = torch.tensor(members).to(x.device, non_blocking=True)
                mine = (group[at] == g).repeat_interleave(
                    torch.tensor([widths[k] for k in members]).to(x.device, non_blocking=True),
                    output_size=sub.shape[1],
                )
                sub = torch.where(mine, sub, 0)
            subs.append(self._encode_group(name, sub, bounds, ids, widths, members, single))
        carries = torch.tensor([[k in members for k in range(len(widths))] for members in carried], dtype=torch.uint8)
        pieces: list[tuple[torch.Tensor, fmt.Length]] = [
            (s.buffer, s.length) if isinstance(s, fmt.Deferred) else (s, s.numel()) for s in subs
        ]
        heads: list[tuple[torch.Tensor, fmt.Length]] = [
            (buffer, self.options[name].head_size(len(members)) or 0)
            for (buffer, _), name, members in zip(pieces, names, carried, strict=True)
        ]
        sections: list[list[tuple[torch.Tensor, fmt.Length]]] = [
            [(group, len(widths))],
            [(carries.reshape(-1), carries.numel())],
            heads,
            *[[p] for p in pieces],
        ]
        header = fmt.Header(self.codec_id, x.dtype, rows, cols, widths, bounds, info=[_DEVICE_LAYOUT, 0, 0, 0])
        return fmt.pack_deferred(header, sections, x.device)

    def _groups_on_device(
        self,
        x: torch.Tensor,
        widths: list[int],
        bounds: list[float] | torch.Tensor,
        choice: list[str],
        names: list[str],
    ) -> torch.Tensor:
        """Each block's group (uint8, on ``x``'s device): its choice's, or the fallback's where
        the choice could exceed the block's bound (:meth:`effective`, decided on the device)."""
        chosen = torch.tensor([names.index(c) for c in choice], dtype=torch.uint8).to(x.device, non_blocking=True)
        unsure = [k for k, c in enumerate(choice) if self._unsure(c) and widths[k] and x.shape[0]]
        if not unsure:
            return chosen
        starts = [sum(widths[:k]) for k in range(len(widths))]
        worst = torch.stack([_worst_case(choice[k], x[:, starts[k] : starts[k] + widths[k]]) for k in unsure])
        eb = bounds if isinstance(bounds, torch.Tensor) else torch.tensor(bounds, dtype=torch.float64)
        at = torch.tensor(unsure).to(x.device, non_blocking=True)
        ok = worst <= eb.to(x.device, non_blocking=True)[at]
        fallback = torch.full_like(ok, names.index(self.fallback), dtype=torch.uint8)
        return chosen.index_copy(0, at, torch.where(ok, chosen[at], fallback))

    def _encode_group(
        self,
        name: str,
        sub: torch.Tensor,
        bounds: list[float] | torch.Tensor,
        keys: torch.Tensor | None,
        widths: list[int],
        members: list[int],
        single: torch.Tensor | None = None,
    ) -> torch.Tensor | fmt.Deferred:
        """One group's payload on the device path (an unbounded option's ignores the bounds and
        the ids; a bounded one chooses between ids and rows on the device where ``single``)."""
        codec, sub_widths = self.options[name], [widths[k] for k in members]
        sub_ids = keys if keys is None or len(members) == len(widths) else keys[:, members]
        if not getattr(codec, "bounded", False):
            return codec.encode(sub, None, sub_ids, blocks=sub_widths)
        if isinstance(bounds, torch.Tensor):
            sub_bounds: list[float] | torch.Tensor = bounds[torch.tensor(members).to(bounds.device, non_blocking=True)]
        else:
            sub_bounds = [bounds[k] for k in members]
        return codec.encode_deferred(sub, sub_bounds, sub_ids, blocks=sub_widths, context=CodecContext(single=single))

    def chooses_ids_on_device(self, device: torch.device) -> bool:
        return not self.backend_for(device).reads_sizes  # (its lossy groups choose)

    def head_size(self, n_blocks: int) -> int:
        """Bytes a decoder needs on the host, at most: a payload of every option as its own
        group, with its head copied in front (section 2), or one option's own payload."""
        options = len(self.options)
        most = max((codec.head_size(n_blocks) or 0 for codec in self.options.values()), default=0)
        padding = 3 * 8  # sections 0 to 2 each padded to 8 bytes
        return fmt.head_bytes(n_blocks, 3 + options, padding + n_blocks * (1 + options) + options * most)

    def prepare_decode(
        self, payload: torch.Tensor, ids: torch.Tensor | None, context: CodecContext = NO_CONTEXT
    ) -> tuple[torch.Tensor | None, object] | None:
        """The device values :meth:`decode` reads on the host besides the payload's head, for
        the groups ``context.choice`` gives (:meth:`device_groups`; the sender's, as every rank
        has the same): each group codec's own (e.g. what the receiver's ids give the lossy codec),
        to be read with every payload's head at once; and the state that goes with them. The
        host backend reads for itself (None)."""
        if self.backend_for(payload.device).reads_sizes or context.choice is None:
            return None
        choice = self._checked_choice(context.choice, len(context.choice))
        names, carried = self.device_groups(choice)
        keys = ids if ids is None or ids.dim() != 1 else ids[:, None].expand(-1, len(choice))
        extras, prepared = [], _Prepared(carried)
        for name, members in zip(names, carried, strict=True):
            sub_keys = None if keys is None else keys[:, members]
            extra, state = self.options[name].prepare_decode(payload, sub_keys) or (None, None)
            if extra is not None:
                extras.append(extra.to(torch.int64).reshape(-1))
            prepared.sizes.append(0 if extra is None else extra.numel())
            prepared.states.append(state)
        return (torch.cat(extras) if extras else None), prepared

    def groups(self, payload: torch.Tensor) -> list[str]:
        """The codec each block of a payload travelled with."""
        codec = codec_for(payload)
        if not isinstance(codec, PerBlockCodec):  # one codec for every block
            return [codec.name] * len(fmt.unpack(payload)[0].widths)
        header, sections = self._header(payload)
        first = 3 if header.info[0] & _DEVICE_LAYOUT else 1
        return [codec_for(sections[first + int(g)]).name for g in sections[0].tolist()]

    def _writer(self, payload: torch.Tensor, head: fmt.HostHead | None) -> tuple[Codec, fmt.HostHead | None]:
        """A chunk whose blocks all use one codec travels as that codec's own payload (see
        :meth:`encode`): that codec decodes it."""
        codec = codec_for(payload, head)
        return (self, head) if isinstance(codec, PerBlockCodec) else (codec, _whole(head))

    def _decode(
        self, payload: Unpacked, ids: torch.Tensor | None, out: torch.Tensor | None, context: CodecContext
    ) -> torch.Tensor:
        """Each group's blocks by its codec; with the payload's head and :meth:`prepare_decode`'s
        values read already, nothing waits for the device where its groups are the ones prepared."""
        header, sections, head = payload.header, payload.sections, payload.head
        widths, nb = header.widths, len(header.widths)
        first, group, carried = _groups(header, sections, head)
        keys = check_ids(ids, header.rows, nb, "per_block decode")
        if out is None:
            out = torch.empty(header.rows, header.cols, dtype=header.dtype, device=payload.device)
        heads = self._sub_heads(head, header, sections, carried) if first == 3 else [None] * len(carried)
        starts = [sum(widths[:k]) for k in range(nb)]
        for g, (sub, members) in enumerate(zip(sections[first:], carried, strict=True)):
            sub_keys = None if keys is None else keys[:, members]
            sub_codec = codec_for(sub, heads[g])
            if group == [g] * nb and len(members) == nb:  # one codec for the whole chunk: into out
                return sub_codec.decode(sub, sub_keys, out=out, head=heads[g])
            part = sub_codec.decode(sub, sub_keys, head=heads[g])
            c = 0
            for k in members:
                if group[k] == g:
                    out[:, starts[k] : starts[k] + widths[k]] = part[:, c : c + widths[k]]
                c += widths[k]
        return out

    def block_bytes(
        self, payload: torch.Tensor, blocks: Sequence[int], head: fmt.HostHead | None = None
    ) -> torch.Tensor:
        """Each block's share of ``payload`` (:meth:`Codec.block_bytes`): of every group payload
        that carries it, its share by the group's own codec; the rest (the group and carried
        maps, the heads' copies, the header, padding) in proportion to the widths. ``head``: as
        :meth:`decode`'s (then nothing is read)."""
        writer, head = self._writer(payload, head)
        if writer is not self:  # one codec for every block
            return writer.block_bytes(payload, blocks, head)
        header, sections = self._header(payload, head)
        first, _, carried = _groups(header, sections, head)
        heads = self._sub_heads(head, header, sections, carried) if first == 3 else [None] * len(carried)
        device, widths = payload.device, header.widths
        own = torch.zeros(len(widths), dtype=torch.float64, device=device)
        for sub, members, sub_head in zip(sections[first:], carried, heads, strict=True):  # (a few options)
            part = codec_for(sub, sub_head).block_bytes(sub, [widths[k] for k in members], sub_head)
            own.index_add_(0, upload(torch.tensor(members, dtype=torch.int64), device), part)
        return own + by_width(payload.numel() - own.sum(), widths, device)

    @staticmethod
    def _sub_heads(
        head: fmt.HostHead | None, header: fmt.Header, sections: list[torch.Tensor], carried: list[list[int]]
    ) -> list[fmt.HostHead | None]:
        """Each group payload's head, from the copies in section 2 read with the payload's head,
        with the values prepared for its group (:meth:`prepare_decode`) where its groups are the
        ones prepared; None where they were not read."""
        heads = None if head is None else head.section(header, 2, sections[2].numel())
        if head is None or heads is None:
            return [None] * len(carried)
        same = isinstance(head.state, _Prepared) and head.state.carried == carried
        prepared = head.state.split(head.extra) if same else None
        out: list[fmt.HostHead | None] = []
        at = 0
        for g, (sub, members) in enumerate(zip(sections[3:], carried, strict=True)):
            read = fmt.HostHead(heads[at:], head.good, [], None)
            n = codec_for(sub, read).head_size(len(members)) or 0
            extra, state = prepared[g] if prepared is not None else ([], None)
            out.append(fmt.HostHead(heads[at : at + n], head.good, extra, state))
            at += n
        return out


_DEVICE_LAYOUT = 1  # info word 0: the device path's layout (sections 1 and 2: carried map, group heads)


@dataclass
class _Prepared:
    """:meth:`PerBlockCodec.prepare_decode`'s state: the groups it prepared for (the blocks each
    carries) and, per group, how many of the values read with the head are its codec's, and the
    state that goes with them."""

    carried: list[list[int]]
    sizes: list[int] = field(default_factory=list)
    states: list[object] = field(default_factory=list)

    def split(self, extra: list[int]) -> list[tuple[list[int], object]]:
        """Each group's values (read) and state."""
        ends = list(itertools.accumulate(self.sizes))
        return [(extra[e - n : e], st) for e, n, st in zip(ends, self.sizes, self.states, strict=True)]


def _whole(head: fmt.HostHead | None) -> fmt.HostHead | None:
    """The head of a payload that one codec wrote for every block (see :meth:`PerBlockCodec.encode`),
    with the values prepared for it where its one group was the one prepared."""
    if head is None:
        return None
    single = isinstance(head.state, _Prepared) and len(head.state.carried) == 1
    extra, state = head.state.split(head.extra)[0] if single else ([], None)
    return fmt.HostHead(head.data, head.good, extra, state)


def _groups(
    header: fmt.Header, sections: list[torch.Tensor], head: fmt.HostHead | None
) -> tuple[int, list[int], list[list[int]]]:
    """(the sections before the group payloads, each block's group, the blocks each group
    carries) of a per_block payload, checked; read with its ``head`` where given."""
    nb = len(header.widths)
    first = 3 if header.info[0] & _DEVICE_LAYOUT else 1
    n_groups = len(sections) - first
    if n_groups < 1 or sections[0].numel() != nb:
        raise PayloadError(f"per_block payload: {len(sections)} sections for {nb} blocks")
    group = list(_host(head, header, 0, sections[0]))
    if first == 3:  # which blocks each group carries
        if sections[1].numel() != n_groups * nb:
            raise PayloadError(f"per_block payload: a carried map of {sections[1].numel()} for {n_groups} x {nb}")
        carries = _host(head, header, 1, sections[1])
        carried = [[k for k in range(nb) if carries[g * nb + k]] for g in range(n_groups)]
    else:
        carried = [[k for k in range(nb) if group[k] == g] for g in range(n_groups)]
    if any(g >= n_groups or k not in carried[g] for k, g in enumerate(group)):
        raise PayloadError(f"per_block payload: block groups {group} beyond its {n_groups} groups or not carried")
    return first, group, carried


def _host(head: fmt.HostHead | None, header: fmt.Header, i: int, section: torch.Tensor) -> bytes:
    """Section ``i``'s bytes: read with the payload's head, else read now (a host wait)."""
    read = None if head is None else head.section(header, i, section.numel())
    return read if read is not None else section.cpu().numpy().tobytes()
