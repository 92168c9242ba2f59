"""A test's tap on the bytes of the pooled-embedding all-to-all, outside the production send path.

:func:`tap` wraps ``torch.distributed.all_to_all_single`` in the calling rank process: a byte
exchange issued inside :func:`dlrm.process.instrument.collective` for a direction (the compressed
all-to-all marks its collectives so) has each peer's payload handed to a hook, which may inspect
or alter (never resize) it before it is sent, as a faulty link would. The size exchange (int64
words) and the raw exchange of compression=auto's ``none`` (the rows as they are) pass untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dlrm.process import instrument

# fn(payload, src=, dst=, direction=, iteration=) -> payload of the same size (global ranks)
Hook = Callable[..., torch.Tensor]

_untapped: Callable[..., Any] | None = None


def tap(hook: Hook | None) -> None:
    """Hand every embedding payload this process sends to ``hook`` (None: send them untouched)."""
    global _untapped
    if _untapped is None:
        _untapped = dist.all_to_all_single
    if hook is None:
        dist.all_to_all_single = _untapped  # type: ignore[assignment]
        return
    send = _untapped

    def all_to_all_single(
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
        group: dist.ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any:
        m = instrument.marked()
        if m is not None and m.channel in instrument.DIRECTIONS and input.dtype == torch.uint8 and input_split_sizes:
            input = _tapped(hook, input, input_split_sizes, group, m)
        return send(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    dist.all_to_all_single = all_to_all_single  # type: ignore[assignment]


def _tapped(
    hook: Hook, buf: torch.Tensor, sizes: list[int], group: dist.ProcessGroup | None, m: instrument.Marked
) -> torch.Tensor:
    """``buf`` with each peer's payload (``sizes[q]`` bytes, none to ourselves) through ``hook``."""
    me = dist.get_rank(group)
    parts = list(buf.split(sizes))
    for q, p in enumerate(parts):
        if q == me or p.numel() == 0:
            continue
        src, dst = (dist.get_global_rank(group, r) if group is not None else r for r in (me, q))
        parts[q] = hook(p, src=src, dst=dst, direction=m.channel, iteration=m.iteration)
        if parts[q].numel() != p.numel():
            raise AssertionError(f"a tap may alter a payload, not resize it ({p.numel()} -> {parts[q].numel()} bytes)")
    return torch.cat(parts) if parts else buf
