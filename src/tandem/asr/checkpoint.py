"""Self-describing recognizer checkpoints: weights with the configuration, alphabet and feature settings
that rebuild the model, plus (for resuming) the training state. Written atomically."""

from __future__ import annotations

import os
import re
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tandem.asr.audio import first_line

__all__ = [
    "FORMAT",
    "VERSION",
    "CheckpointError",
    "CheckpointVersionError",
    "CheckpointStore",
    "CheckpointWriteError",
    "write_run_files",
    "atomic_write",
    "save_checkpoint",
    "load_checkpoint",
    "read_checkpoint_file",
    "not_written",
]

FORMAT = "tandem.asr.recognizer"
VERSION = 1
_REQUIRED = ("model_config", "feature_config", "alphabet", "model")


class CheckpointError(ValueError):
    """A file that is not a readable recognizer checkpoint of a version this tandem knows."""


class CheckpointVersionError(CheckpointError):
    """A checkpoint of a version this tandem does not read (another tandem's, a newer one's): no run may
    go on past it from an older checkpoint, whose saves would replace and rotate it away."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint that could not be written (a full disk, a file size limit, a folder gone). The
    message names the file, the reason and the free space where it was going; whatever was there before
    is left as it was."""


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
        _fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def _fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (a crash after it cannot bring the old name back)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a folder; the rename itself is still atomic
    finally:
        os.close(fd)


def save_checkpoint(state: dict[str, Any], path: Path) -> None:
    """Save ``state`` (which holds at least the model's configuration, feature settings, alphabet
    characters and ``model`` state_dict) with the format's name and version, atomically. A write that
    fails raises :class:`CheckpointWriteError` and leaves ``path`` as it was."""
    missing = [k for k in _REQUIRED if k not in state]
    if missing:
        raise ValueError(f"save_checkpoint: expected keys {list(_REQUIRED)}, missing {missing}")
    full = {"format": FORMAT, "version": VERSION, **state}
    try:
        atomic_write(lambda tmp: torch.save(full, tmp), path)
    except (OSError, RuntimeError) as e:
        raise CheckpointWriteError(not_written(path, e, _tensor_bytes(full))) from e


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def not_written(path: Path, error: BaseException, size: int | None = None) -> str:
    """Why ``path`` was not written, as a message: ``error``'s reason, the free space in its folder and,
    given, the ``size`` in bytes that was going there."""
    # torch.save reports a failed write as its C++ writer's assertion ("unexpected pos 704 vs 598"), not
    # the OS error: the free space and the size beside it tell a full disk from the rest
    reason = getattr(error, "strerror", None) or first_line(error) or type(error).__name__
    try:
        free = f"{shutil.disk_usage(path.parent).free / 2**20:.1f} MiB free there"
    except OSError:
        free = "its folder unreadable"
    need = f" for ~{size / 2**20:.1f} MiB of tensors" if size else ""
    return f"{path}: not written ({reason}); {free}{need}"


def write_run_files(out: Path, metrics: str, plot: Callable[[Path], bool], written: list[str]) -> str | None:
    """A finished run's files in ``out``: ``metrics.json`` (the text ``metrics``), then
    ``training_curve.png`` where ``plot(path)`` draws one. Appends to ``written`` the names written;
    returns None, or the error line of the first file that could not be written (a full disk), which
    also names what the run wrote."""
    name = "metrics.json"
    try:
        atomic_write(lambda tmp: tmp.write_text(metrics + "\n"), out / name)
        written.append(name)
        name = "training_curve.png"
        if plot(out / name):
            written.append(name)
    except OSError as e:
        done = f"wrote {', '.join(written)} to {out}" if written else "wrote nothing more"
        return f"tandem train: error: {not_written(out / name, e)}; the run is done and {done}"
    return None


def read_checkpoint_file(path: str | Path, map_location: str | torch.device = "cpu") -> Any:
    """What a checkpoint file of ``tandem train`` (either task) holds, read by ``torch.load`` with weights
    only once the file is found whole: :class:`CheckpointError` naming the file if it is missing, not a
    regular file, damaged in place (a member whose checksum does not match) or unreadable."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(
            f"{path}: a directory, not a checkpoint file (tandem train writes checkpoint.pt in it)"
        )
    if path.exists() and not path.is_file():
        raise CheckpointError(
            f"{path}: not a regular file (a pipe, a device or a socket); expected the checkpoint file itself "
            "(torch.load reads it in pieces)"
        )
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    damaged = _damaged_member(path)
    if damaged is not None:
        # torch.load reads bytes changed in place (a bad disk, a copy gone wrong) as numbers, without a
        # word: a weight of NaN transcribed every file to nothing
        raise CheckpointError(f"{path}: a corrupt checkpoint ({damaged}: its checksum does not match)")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        # Bytes that are not a checkpoint fail anywhere in the unpickler, with any exception (a text file:
        # KeyError from the weights-only unpickler's memo), not only the ones named here before.
        first = first_line(e).split(". ")[0]  # torch's first sentence
        detail = f"{type(e).__name__}: {first}" if first else type(e).__name__
        problem = f"not a readable checkpoint (truncated or corrupt?): {detail}"
        raise CheckpointError(f"{path}: {problem}") from None
    return state


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a recognizer checkpoint; any file that is not one (missing, truncated, another kind of
    checkpoint, a newer version) raises :class:`CheckpointError` naming the file and the problem."""
    path = Path(path)
    state = read_checkpoint_file(path, map_location)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: not a speech-recognizer checkpoint (expected format {FORMAT!r}, got "
            f"{state.get('format') if isinstance(state, dict) else type(state).__name__!r}; a checkpoint of "
            "`tandem train --task classify`?)"
        )
    if state.get("version") != VERSION:
        raise CheckpointVersionError(
            f"{path}: checkpoint version {state.get('version')!r}, this tandem reads version {VERSION} "
            "(written by another tandem: use that one)"
        )
    missing = [k for k in _REQUIRED if k not in state]
    if missing:
        raise CheckpointError(f"{path}: incomplete checkpoint, missing {missing}")
    model = state["model"]
    for name, tensor in model.items() if isinstance(model, dict) else ():
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not tensor.isfinite().all():
            # training never writes one (a step that makes one stops the run before its checkpoint)
            raise CheckpointError(f"{path}: the model's {name} holds NaN or infinite values")
    return state


def _damaged_member(path: Path) -> str | None:
    """The first member of a checkpoint (torch.save's zip archive) whose CRC-32 does not match its bytes,
    or None (also for a file that is no zip archive: torch.load judges it)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError):
        return None


class CheckpointStore:
    """The checkpoints of a training run in ``folder``, rotated.

    Each save writes ``checkpoint-<step>.pt`` atomically, then points ``checkpoint.pt`` (the name users and
    ``tandem transcribe`` know) at it with an atomic rename of a hard link (a copy where links are not
    possible), and only then deletes the oldest numbered checkpoints beyond ``keep``: at every moment the
    folder holds a complete newest checkpoint. :meth:`latest` reads ``checkpoint.pt`` and, if that is
    unreadable (truncated, corrupt), the numbered ones from the newest down, and says which it skipped.

    Example::

        >>> store = CheckpointStore(Path("runs/asr"), keep=2)
        >>> store.save(state, step=120)          # runs/asr/checkpoint-00000120.pt and checkpoint.pt
        >>> state, path, skipped = store.latest()
    """

    NAME = "checkpoint.pt"

    def __init__(self, folder: Path, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"CheckpointStore: expected keep >= 1, got {keep}")
        self.folder, self.keep = Path(folder), keep

    @property
    def path(self) -> Path:
        return self.folder / self.NAME

    def numbered(self) -> list[Path]:
        """The numbered checkpoints, oldest first (by step, then by name)."""

        def step(p: Path) -> int:
            digits = p.stem.removeprefix("checkpoint-")
            return int(digits) if digits.isdigit() else -1

        return sorted((p for p in self.folder.glob("checkpoint-*.pt") if step(p) >= 0), key=step)

    def save(self, state: dict[str, Any], step: int) -> Path:
        """Write ``state`` as the newest checkpoint (see the class docstring); returns its numbered path.
        Raises :class:`CheckpointWriteError` if it cannot, with ``checkpoint.pt`` still the one before."""
        target = self.folder / f"checkpoint-{step:08d}.pt"
        save_checkpoint(state, target)
        link = self.folder / f".{self.NAME}.link-{os.getpid()}"
        link.unlink(missing_ok=True)
        try:
            try:
                os.link(target, link)
            except OSError:
                shutil.copyfile(target, link)
            os.replace(link, self.path)
        except OSError as e:
            link.unlink(missing_ok=True)
            raise CheckpointWriteError(not_written(self.path, e)) from e
        _fsync_dir(self.folder)
        for old in self.numbered()[: -self.keep]:
            if old != target:
                old.unlink(missing_ok=True)
        return target

    def leftovers(self) -> list[Path]:
        """The files that processes which died mid-write left in the folder: :func:`atomic_write`'s
        ``.NAME.tmp-PID`` of checkpoints, metrics and the curve, and :meth:`save`'s
        ``.checkpoint.pt.link-PID``. A process killed outright (SIGKILL, the OOM killer, a second Ctrl-C,
        which ends every process at once) leaves them; a run that holds the folder can remove them, as no
        one else writes there. Only those names (no link): nothing else of the folder's is touched."""
        part = re.compile(
            r"\.(checkpoint(-\d+)?\.pt|metrics\.json|training_curve\.png)\.tmp-\d+|\.checkpoint\.pt\.link-\d+"
        )
        return sorted(
            p for p in self.folder.glob(".*") if part.fullmatch(p.name) and p.is_file() and not p.is_symlink()
        )

    def remove_leftovers(self) -> None:
        """Delete :meth:`leftovers` (at a run's start, by the process that holds the folder)."""
        for partial in self.leftovers():
            partial.unlink(missing_ok=True)

    # what else a run leaves in its folder: set aside with its checkpoints, so that a new run's folder
    # never shows an earlier run's metrics, curves or TensorBoard events beside its own checkpoints
    RUN_FILES = ("metrics.json", "training_curve.png", "events.out.tfevents.*")

    def set_aside(self) -> Path | None:
        """Move an earlier run's checkpoints, and the files it wrote beside them (:attr:`RUN_FILES`), into a
        new folder in the folder: ``previous/``, or ``previous-2/``, ``previous-3/``... when earlier runs
        went there already (nothing is ever deleted), so that a fresh run starts with none of them; the
        folder they went to, or None if there were no checkpoints."""
        found = [p for p in [*self.numbered(), self.path] if p.exists()]
        if not found:
            return None
        found += [p for pattern in self.RUN_FILES for p in self.folder.glob(pattern) if p.is_file()]
        aside = self.folder / "previous"
        n = 1
        while aside.exists():
            n += 1
            aside = self.folder / f"previous-{n}"
        aside.mkdir()
        for p in found:
            os.replace(p, aside / p.name)
        return aside

    def set_aside_and_say(self) -> None:
        """:meth:`set_aside`, and a line on stdout saying where the earlier run went (a fresh run's start,
        for both tasks of ``tandem train``)."""
        aside = self.set_aside()
        if aside is not None:
            print(
                f"tandem train: {self.folder} held an earlier run's checkpoints and outputs; moved to "
                f"{aside} (to continue a run, use --resume)",
                flush=True,
            )

    def latest(
        self, map_location: str | torch.device = "cpu"
    ) -> tuple[dict[str, Any] | None, Path | None, list[str]]:
        """(state, its path, problems of the newer files skipped), or (None, None, problems) when no
        checkpoint in the folder can be read. A checkpoint of another version raises its
        :class:`CheckpointVersionError`: it is no file to skip (a run resumed from an older one would
        replace and delete it)."""
        skipped: list[str] = []
        candidates = [self.path] + list(reversed(self.numbered()))
        for path in dict.fromkeys(candidates):
            if not path.exists():
                continue
            try:
                return load_checkpoint(path, map_location), path, skipped
            except CheckpointVersionError:
                raise
            except CheckpointError as e:
                skipped.append(str(e))
        return None, None, skipped
