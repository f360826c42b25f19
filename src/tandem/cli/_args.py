"""argparse value types shared by the subcommands: errors name what was expected and what came."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

__all__ = [
    "MAX_THREADS",
    "epochs",
    "layers",
    "nonempty_path",
    "port",
    "positive_int",
    "positive_float",
    "seconds",
    "seed",
    "threads",
    "wait_seconds",
    "workers",
]

# More threads than this is a typo (torch takes a C int; 4096 is beyond any machine's cores)
MAX_THREADS = 4096
# The longest wait taken, in seconds (~116 days): beyond, a timedelta (and torch's milliseconds) overflow
MAX_SECONDS = 1e7


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _int_in(text: str, low: int, high: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        came = text if value is not None else repr(text)
        raise argparse.ArgumentTypeError(f"expected {what} from {low} to {high}, got {came}")
    return value


def port(text: str) -> int:
    """A TCP port, 1 to 65535."""
    return _int_in(text, 1, 65535, "a port")


def seed(text: str) -> int:
    """A random seed, 0 to 2**32 - 1 (numpy's legacy range; the runs derive their other seeds from it)."""
    return _int_in(text, 0, 2**32 - 1, "a seed")


def threads(text: str) -> int:
    """A thread count, 1 to :data:`MAX_THREADS`."""
    return _int_in(text, 1, MAX_THREADS, "a thread count")


# Bounds past which a value is a typo, not a run: a billion layers made the launcher count a model for
# ever, a billion loader workers forked without end, a billion epochs planned every epoch's batches first
MAX_LAYERS = 1000
MAX_EPOCHS = 10_000
MAX_WORKERS = 256


def layers(text: str) -> int:
    """A number of recurrent layers, 1 to :data:`MAX_LAYERS`."""
    return _int_in(text, 1, MAX_LAYERS, "a number of layers")


def epochs(text: str) -> int:
    """A number of epochs, 1 to :data:`MAX_EPOCHS`."""
    return _int_in(text, 1, MAX_EPOCHS, "a number of epochs")


def workers(text: str) -> int:
    """A number of data-loading worker processes, 0 to :data:`MAX_WORKERS`."""
    return _int_in(text, 0, MAX_WORKERS, "a number of worker processes")


def wait_seconds(text: str) -> int:
    """A whole number of seconds to wait, 1 to :data:`MAX_SECONDS` (beyond, a timedelta overflows)."""
    return _int_in(text, 1, int(MAX_SECONDS), "whole seconds")


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def seconds(text: str) -> float:
    """A timeout in seconds, 1 to :data:`MAX_SECONDS` (less than a second fails any collective)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 1 <= value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"expected seconds from 1 to {MAX_SECONDS:g}, got {text!r}")
    return value


def nonempty_path(text: str) -> Path:
    """A file or folder name; not empty (``Path("")`` is the current folder)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a path, got ''")
    return Path(text)
