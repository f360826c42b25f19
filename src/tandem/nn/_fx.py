"""torch.fx's symbolic tracing keeps torch.nn's modules whole (a ``call_module`` node: they are its leaf
modules) and traces into every other module's forward. tandem's modules stand in for torch.nn's, so a model
that holds them traces as it did with torch's: each one is a leaf too."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

__all__ = ["fx_leaf"]


def fx_leaf(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
    """The ``call_module`` node of ``module`` called with ``args`` and ``kwargs`` when one of them is a
    symbolic tracer's Proxy (what ``torch.fx.Tracer.call_module`` makes of a leaf module), else None: also
    for the traced root itself, which torch.fx traces into (torch's modules there fail as tandem's do)."""
    kwargs = kwargs or {}
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.fx.Proxy):
            tracer = value.tracer
            if module is getattr(tracer, "root", None):
                return None
            return tracer.create_proxy("call_module", tracer.path_of_module(module), args, kwargs)
    return None
