"""Count the operations that make a CUDA host wait for its device, seen at the dispatcher.

Why: each one stalls the device's queue and undoes the overlap of compute and communication. On
CPU tensors they cost nothing, so a CPU run cannot time them, but the ops are the same on every
device, so it can count them::

    with HostSyncCounter() as c:
        with c.label("encode"):
            payload = codec.encode(x, eb)
    c.total, c.by_op, c.by_label, c.counts[("encode", "item")]

Counted: ``item`` (``.item()``, ``float(t)``, ``int(t)``, ``bool(t)``: ``aten._local_scalar_dense``),
ops whose output size depends on the data (``nonzero``, ``unique``, ``masked_select``,
``bincount``, ``bool_index`` / ``bool_index_put``: indexing with a boolean or uint8 mask,
``repeat_interleave`` without ``output_size``), ``equal`` (its answer is a host bool), and copies
between host and device (``to_host``; ``to_device`` unless ``non_blocking``). Not seen:
``.numpy()``, ``.tolist()`` and ``.cpu()`` of a CPU tensor (no op reaches the dispatcher), and
``torch.tensor(data, device=...)`` (its copy runs below the dispatcher's Python key); dispatch
modes are per thread, so work in other threads is not counted either.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dlrm_compression import ops

aten = torch.ops.aten

# Ops that always wait for the device: a host value, or an output whose size is the data's.
_ALWAYS = {
    aten._local_scalar_dense: "item",
    aten.nonzero: "nonzero",
    aten._unique: "unique",
    aten._unique2: "unique",
    aten.unique_dim: "unique",
    aten.unique_consecutive: "unique",
    aten.unique_dim_consecutive: "unique",
    aten.masked_select: "masked_select",
    aten.bincount: "bincount",
    aten.equal: "equal",
}
_INDEX_PUT = {aten.index_put, aten.index_put_, aten._index_put_impl_}
_MASKS = (torch.bool, torch.uint8)
_HERE = os.path.abspath(__file__)
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


class Sync(NamedTuple):
    """One counted op: its kind, the label active then, and the caller's ``file:line`` ("" untraced)."""

    op: str
    label: str
    where: str


class HostSyncCounter(TorchDispatchMode):
    """Counts host synchronisations by op and by label while active; results are unchanged.

    ``count_cpu``: CPU tensors stand for device tensors (the CPU proxy; set False on a GPU to count
    only real syncs). ``trace``: also record each sync's first caller frame outside torch in
    :attr:`events` (slow; for finding the line to change). Counters nest: each counts every op.
    """

    def __init__(self, count_cpu: bool = True, trace: bool = False) -> None:
        super().__init__()
        self.count_cpu, self.trace = count_cpu, trace
        self.counts: Counter[tuple[str, str]] = Counter()  # (label, op) -> syncs
        self.events: list[Sync] = []
        self.labels: list[str] = []  # every label entered, first entry first (with or without syncs)
        self.launches: Counter[str] = Counter()  # label -> dispatcher ops that launch work (see launches_of)
        self.launched: Counter[str] = Counter()  # aten op -> how many of them launched
        self._stack: list[str] = []

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def by_op(self) -> Counter[str]:
        return _sum_by(self.counts, 1)

    @property
    def by_label(self) -> Counter[str]:
        return _sum_by(self.counts, 0)

    @contextmanager
    def label(self, name: str) -> Iterator[None]:
        """Attribute the syncs inside to ``name`` (nested labels join with "/"; none: "")."""
        self._stack.append(name)
        full = "/".join(self._stack)
        if full not in self.labels:
            self.labels.append(full)
        try:
            yield
        finally:
            self._stack.pop()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        n = _launches(func, args, kwargs)
        if n and self._launch_on_device(args, kwargs):
            self.launches["/".join(self._stack)] += n
            self.launched[func.overloadpacket.__name__] += n
        op = self._sync(func, args, kwargs)
        if op is not None:
            self.note(op)
        return func(*args, **kwargs)

    def note(self, op: str, where: str | None = None, launch: bool = False) -> None:
        """Count one sync of kind ``op`` under the active label (also for syncs the dispatcher
        cannot see, e.g. ``.tolist()`` of a CPU tensor standing for a device one, made at
        ``where``: ``file:line``; default: the first caller outside torch and this module), but
        none inside a codec op (:mod:`compression.ops`: its CUDA kernels wait for nothing).
        ``launch``: it is also a launch the dispatcher did not see (a copy to the host)."""
        if ops.running():  # a codec op's CPU implementation: its CUDA kernels read nothing on the host
            return
        label = "/".join(self._stack)
        self.counts[(label, op)] += 1
        if launch:
            self.launches[label] += 1
            self.launched["to_host"] += 1
        if self.trace:
            self.events.append(Sync(op, label, where or _caller()))

    def _launch_on_device(self, args: tuple, kwargs: dict) -> bool:
        """Whether an op runs where it counts: on a tensor argument's device, or a factory's."""
        tensors = list(_tensors(args, kwargs))
        if tensors:
            return any(self._on_device(t) for t in tensors)
        device = kwargs.get("device")
        return self.count_cpu or (device is not None and torch.device(device).type != "cpu")

    def _on_device(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and (t.device.type != "cpu" or self.count_cpu)

    def _sync(self, func: Any, args: tuple, kwargs: dict) -> str | None:
        """The kind of sync ``func(*args, **kwargs)`` is, or None if the host need not wait for it."""
        packet = func.overloadpacket
        if packet in _ALWAYS:
            return _ALWAYS[packet] if self._on_device(args[0]) else None
        if packet is aten.repeat_interleave and func._overloadname in ("Tensor", "Tensor_out"):
            return "repeat_interleave" if kwargs.get("output_size") is None and self._on_device(args[0]) else None
        if packet is aten.index and _has_mask(args[1]):
            return "bool_index" if self._on_device(args[0]) else None
        if packet in _INDEX_PUT and _has_mask(args[1]):
            # one mask and a one-element value on the host (a Python number: `x[mask] = 0`, even on
            # CUDA): PyTorch takes masked_fill_, no sync
            values = args[2]
            if len([i for i in args[1] if i is not None]) == 1 and values.numel() == 1 and values.device.type == "cpu":
                return None
            return "bool_index_put" if self._on_device(args[0]) else None
        if packet is aten._to_copy:
            dst = kwargs.get("device")
            return _copy_kind(
                args[0].device, args[0].device if dst is None else torch.device(dst), kwargs.get("non_blocking", False)
            )
        if packet is aten.copy_:
            return _copy_kind(
                args[1].device, args[0].device, args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            )
        return None


# Ops that launch no kernel: memory handed out (the allocator), not written; a sparse tensor's
# metadata asked for (its flags and sizes, kept on the host).
_NO_KERNEL = {
    *(aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided),
    *(aten.is_coalesced, aten._nnz, aten.sparse_dim, aten.dense_dim),
}


def _launches(func: Any, args: tuple = (), kwargs: dict | None = None) -> int:
    """The kernel launches ``func`` stands for: one per aten op but views (metadata alone),
    allocations and metadata queries; a codec op (:mod:`compression.ops`) as many as its CUDA implementation makes."""
    if func.namespace == "dlrm_compression":
        n = ops.LAUNCHES[func.overloadpacket.__name__]
        return n(*args, **(kwargs or {})) if callable(n) else n
    return 0 if func.is_view or func.overloadpacket in _NO_KERNEL else 1


def _tensors(args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


def _sum_by(counts: Counter[tuple[str, str]], key: int) -> Counter[str]:
    out: Counter[str] = Counter()
    for k, n in counts.items():
        out[k[key]] += n
    return out


def _has_mask(indices: list) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in _MASKS for i in indices)


def _copy_kind(src: torch.device, dst: torch.device, non_blocking: bool) -> str | None:
    """A copy between host and device: to the host always waits; to the device unless non_blocking."""
    if src.type != "cpu" and dst.type == "cpu":
        return "to_host"
    if src.type == "cpu" and dst.type != "cpu" and not non_blocking:
        return "to_device"
    return None


def _caller() -> str:
    """``file:line`` of the innermost frame outside torch and this module (cwd-relative)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path != _HERE and not path.startswith(_TORCH):
            return f"{os.path.relpath(path)}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"
