"""What the benchmarks' command lines share."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Options = TypeVar("Options", bound="DataclassInstance")


def options_from(cls: type[Options], args: argparse.Namespace, **given: Any) -> Options:
    """The dataclass ``cls`` of a parsed command line: each field ``given``, else the argument of
    its name (so that a new option is declared once, as a field and an argument)."""
    taken = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.name not in given}
    return cls(**taken, **given)
