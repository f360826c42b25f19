"""The benchmark registry: each op registers its providers and shapes once; ``tandem bench`` runs them.

A provider is a factory ``(params, device, mode) -> thunk``: it builds the module, inputs and anything
else outside the timed region and returns a zero-argument callable that runs one measured unit (for
example one training step), or None where it does not apply (a variant that exists on one device
only). The runner times every provider of a shape side by side in one process and reports the speedup
of each provider over ``baseline``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Shape", "OpBench", "REGISTRY", "register"]

Thunk = Callable[[], Any]
Provider = Callable[[dict[str, Any], torch.device, str], Thunk]


@dataclass(frozen=True)
class Shape:
    """One benchmarked problem size. ``id`` is what tables print, e.g. ``"T50-B32-I128-H256-bi"``."""

    id: str
    params: dict[str, Any]
    quick: bool = False  # part of the one-minute ``--quick`` subset
    devices: tuple[str, ...] = ("cpu", "cuda")  # device types this shape is meant for


@dataclass(frozen=True)
class OpBench:
    """Everything ``tandem bench --op <op>`` needs to time one op against its PyTorch counterpart."""

    op: str
    providers: dict[str, Provider]
    shapes: tuple[Shape, ...]
    modes: tuple[str, ...] = ("train",)
    baseline: str = "torch"
    description: str = ""
    # How to time a thunk: "timer" (in-process timing of the thunk) is the default; an op whose thunk
    # measures itself (multi-process benchmarks) returns a list of per-repeat seconds and sets "self".
    timing: str = "timer"
    # extra["summary"], if present: rows of this op -> text that ``tandem bench`` prints under the table.
    extra: dict[str, Any] = field(default_factory=dict)


REGISTRY: dict[str, OpBench] = {}


def register(bench: OpBench) -> OpBench:
    """Add ``bench`` to the registry under ``bench.op`` (an op registers once)."""
    if bench.op in REGISTRY:
        raise ValueError(f"register: op {bench.op!r} is already registered")
    if bench.baseline not in bench.providers:
        raise ValueError(
            f"register: baseline {bench.baseline!r} is not one of the providers {sorted(bench.providers)}"
        )
    REGISTRY[bench.op] = bench
    return bench
