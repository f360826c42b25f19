"""torch.fx's symbolic tracing keeps torch.nn's modules whole (a ``call_module`` node: they are its leaf
modules) and traces into every other module's forward. tandem's modules stand in for torch.nn's, so a model
that holds them traces as it did with torch's: each one is a leaf too."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

__all__ = ["fx_leaf", "ours", "runs_own_forward", "tandem_forward"]


def ours(cls: type) -> bool:
    """``cls`` is torch's, tandem's or ``object``: not a class of the user's (a subclass, a mixin)."""
    return cls is object or cls.__module__.split(".")[0] in ("torch", "tandem")


def runs_own_forward(module: torch.nn.Module) -> bool:
    """The forward that ``module`` runs is a user's class's (a subclass's), not tandem's."""
    return not ours(next(c for c in type(module).__mro__ if "forward" in vars(c)))


def fx_leaf(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
    """The ``call_module`` node of ``module`` called with ``args`` and ``kwargs`` when one of them is a
    symbolic tracer's Proxy (what ``torch.fx.Tracer.call_module`` makes of a leaf module), else None: also
    for the traced root itself, which torch.fx traces into (torch's modules there fail as tandem's do).

    A subclass with a forward of its own (:func:`runs_own_forward`) is user code, which torch.fx traces
    into; when that forward calls ``super().forward``, the node is a call of :func:`tandem_forward` on the
    module (a ``call_module`` would run the subclass's whole forward again)."""
    kwargs = kwargs or {}
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.fx.Proxy):
            tracer = value.tracer
            if module is getattr(tracer, "root", None):
                return None
            path = tracer.path_of_module(module)
            if not runs_own_forward(module):
                return tracer.create_proxy("call_module", path, args, kwargs)
            this = tracer.create_proxy("get_attr", path, (), {})
            return tracer.create_proxy("call_function", tandem_forward, (this, *args), kwargs)
    return None


def tandem_forward(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``module``'s forward as tandem's class of it defines it (what its subclass's ``super().forward``
    calls): the target of the traced node, a function of this module (a graph's code imports it)."""
    for cls in type(module).__mro__:
        if cls.__module__.startswith("tandem.nn.") and "forward" in vars(cls):
            return vars(cls)["forward"](module, *args, **kwargs)
    raise TypeError(f"tandem_forward: expected a tandem.nn module, got {type(module).__name__}")
