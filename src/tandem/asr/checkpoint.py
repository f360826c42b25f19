"""Self-describing recognizer checkpoints: weights with the configuration, alphabet and feature settings
that rebuild the model, plus (for resuming) the training state. Written atomically."""

from __future__ import annotations

import os
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["FORMAT", "VERSION", "CheckpointError", "atomic_write", "save_checkpoint", "load_checkpoint"]

FORMAT = "tandem.asr.recognizer"
VERSION = 1
_REQUIRED = ("model_config", "feature_config", "alphabet", "model")


class CheckpointError(ValueError):
    """A file that is not a readable recognizer checkpoint of a version this tandem knows."""


def atomic_write(write: Callable[[Path], Any], path: Path) -> None:
    """Write through ``write(tmp_path)``, flush to disk, then rename: readers see the old file or the new,
    never half of one, even if the process dies mid-write."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_checkpoint(state: dict[str, Any], path: Path) -> None:
    """Save ``state`` (which holds at least the model's configuration, feature settings, alphabet
    characters and ``model`` state_dict) with the format's name and version, atomically."""
    missing = [k for k in _REQUIRED if k not in state]
    if missing:
        raise ValueError(f"save_checkpoint: expected keys {list(_REQUIRED)}, missing {missing}")
    full = {"format": FORMAT, "version": VERSION, **state}
    atomic_write(lambda tmp: torch.save(full, tmp), path)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a recognizer checkpoint; any file that is not one (missing, truncated, another kind of
    checkpoint, a newer version) raises :class:`CheckpointError` naming the file and the problem."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError, zipfile.BadZipFile, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: not a readable checkpoint (truncated or corrupt?): {first}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: not a speech-recognizer checkpoint (expected format {FORMAT!r}, got "
            f"{state.get('format') if isinstance(state, dict) else type(state).__name__!r}); "
            "`tandem train --task classify` checkpoints cannot transcribe"
        )
    if state.get("version") != VERSION:
        raise CheckpointError(
            f"{path}: checkpoint version {state.get('version')!r}, this tandem reads version {VERSION}"
        )
    missing = [k for k in _REQUIRED if k not in state]
    if missing:
        raise CheckpointError(f"{path}: incomplete checkpoint, missing {missing}")
    return state
