"""Drop-in modules: thin wrappers that validate arguments, own parameters and call ``tandem.ops``."""

from __future__ import annotations

__all__: list[str] = []
