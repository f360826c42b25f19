"""A training process's standard output and error that may fail (a closed pipe, a full disk) without
ending the run."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, TextIO

__all__ = ["keep_going_without_output", "to_null_device"]


class _ForgivingStream:
    """``stream`` (sys.stdout or sys.stderr) whose first failed write or flush sends the rest of its output
    to the null device: ``note`` on stderr once (where stderr still works), then the process goes on.
    Everything else is the stream's own."""

    def __init__(self, stream: TextIO, note: str | None) -> None:
        self._stream, self._note, self._lost = stream, note, False

    def write(self, text: str) -> int:
        if not self._lost:
            try:
                return self._stream.write(text)
            except OSError as e:
                self._lose(e)
        return len(text)

    def flush(self) -> None:
        if not self._lost:
            try:
                self._stream.flush()
            except OSError as e:
                self._lose(e)

    def _lose(self, error: OSError) -> None:
        self._lost = True
        with contextlib.suppress(OSError):
            to_null_device(self._stream)
        if self._note is not None:
            reason = error.strerror or type(error).__name__
            print(f"{self._note} ({reason})", file=sys.stderr, flush=True)  # (forgiving too)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def to_null_device(stream: TextIO) -> None:
    """Point ``stream``'s file descriptor at the null device after a write to it failed: what it still
    holds goes there at its next flush (at exit), so the interpreter's own flush does not fail (an
    "Exception ignored" report, exit status 120; Python's documented remedy for a broken pipe)."""
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), stream.fileno())


def keep_going_without_output(note: str) -> None:
    """From now on a failing sys.stdout or sys.stderr (``| head``, ``2>&1 | head``, a log on a full disk)
    loses this process's messages, not its work: for stdout ``note`` (and the reason) on stderr once; then
    the stream's output goes to the null device. A stream without a file descriptor is left as it is."""
    for name, said in (("stderr", None), ("stdout", note)):
        stream = getattr(sys, name)
        try:
            stream.fileno()
        except (AttributeError, OSError, ValueError):  # replaced by something without a descriptor
            continue
        if not isinstance(stream, _ForgivingStream):
            setattr(sys, name, _ForgivingStream(stream, said))
