"""Stopping a training run cleanly: signals in the workers (and in their DataLoader workers), workers that do
not outlive their launcher, and work in a thread of its own so that a signal lands in the main thread."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

__all__ = [
    "EXIT_FILE_ENV",
    "LAUNCHER_PID_ENV",
    "Background",
    "LoaderWorkerInit",
    "StopRequests",
    "collective_exit",
    "die_with_parent",
    "die_with_torchrun",
    "end_workers",
    "parent_of",
    "release_stop_signals",
    "start_holding_stop_signals",
    "stop_signals_held",
]

# Where the ranks under tandem train's launcher leave an exit status that a restart would meet again (bad
# data, a diverged loss, a checkpoint not written): they exit 0 so that torchrun ends instead of
# restarting them, and the launcher returns the status it finds there.
EXIT_FILE_ENV = "TANDEM_TRAIN_EXIT_FILE"


def collective_exit(code: int) -> int:
    """The exit status of a rank for ``code``, a status every rank reached together (each from a collective
    verdict): under tandem train's launcher (``EXIT_FILE_ENV`` set) a non-zero one goes to that file and the
    rank exits 0, so torchrun neither restarts the ranks into what ended them nor reports a failure; each
    node's launcher learns it from its own ranks. Elsewhere ``code`` itself."""
    if code != 0 and os.environ.get(EXIT_FILE_ENV):
        Path(os.environ[EXIT_FILE_ENV]).write_text(f"{code}\n")
        return 0
    return code


class StopRequests:
    """SIGINT and SIGTERM as requests: the first asks the run to stop after its current step (the loop reads
    :attr:`signal`), the second ends the process at once. Checkpoints are written atomically, so leaving in
    the middle of one keeps the previous. The same signal again within :attr:`SAME_REQUEST_S` of the first
    is the same request: a signal sent to a whole process tree (Slurm, systemd, ``kill -- -PGID``) reaches
    a worker twice, directly and forwarded by tandem train's launcher (or by a torchrun started by hand),
    and must not cost the stop's checkpoint. Only under torchrun (``WORLD_SIZE`` set): a single process
    (``--nproc 1``) gets each signal once, so a second Ctrl-C within the second is a person's second
    request, as the launcher takes it.

    Example::

        >>> stop = StopRequests().install()
        >>> while not stop.signal:
        ...     step()
    """

    SAME_REQUEST_S = 1.0

    def __init__(self) -> None:
        self.signal: int | None = None
        self._first = 0.0
        self._same_within = self.SAME_REQUEST_S if "WORLD_SIZE" in os.environ else 0.0

    def install(self) -> StopRequests:
        """Take SIGINT and SIGTERM from now on; one held back until now (see
        :func:`start_holding_stop_signals`) arrives here as the first request, except torchrun's own
        SIGTERM, with which it ends the group when another rank failed as they started: this process
        ends at once, as it would have without the hold (it waited for the stop request's step, which
        the others never reach, until torchrun killed it 30 s later)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)
        if os.environ.get(LAUNCHER_PID_ENV) and hasattr(signal, "sigtimedwait"):
            # under tandem train's launcher torchrun holds the signals too: one from it is its own
            while (held := signal.sigtimedwait(STOP_SIGNALS, 0)) is not None:
                if held.si_signo == signal.SIGTERM and held.si_pid == os.getppid():
                    os._exit(128 + held.si_signo)
                self._handle(held.si_signo, None)
        release_stop_signals()
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is not None:
            if signum == self.signal and time.monotonic() - self._first < self._same_within:
                return  # the same request, delivered twice
            sys.stderr.write(f"tandem train: second {signal.Signals(signum).name}, leaving at once\n")
            os._exit(128 + signum)
        self.signal, self._first = signum, time.monotonic()

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal else ""


def die_with_parent(parent: int | None = None) -> None:
    """Have Linux kill this process (SIGKILL) when its parent dies: torchrun starts workers in sessions of
    their own, so without this a launcher killed outright leaves its workers running. No-op elsewhere.
    ``parent``: the parent's pid, taken before the fork (a ``preexec_fn``, a DataLoader worker's init): if
    the parent has died already, before the request took effect, this process exits at once. Without it
    nothing is checked: a parent that is pid 1 may be alive (a container's first process), not init."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent is not None and os.getppid() != parent:  # it died before the request took effect
        os._exit(1)


# the signals that ask a run to stop (see StopRequests)
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}

# tandem train's launcher names itself to the ranks of its torchrun here (see die_with_torchrun)
LAUNCHER_PID_ENV = "TANDEM_TRAIN_LAUNCHER_PID"


def die_with_torchrun() -> None:
    """A torchrun worker: Linux kills it when torchrun dies (:func:`die_with_parent`). Under tandem train's
    launcher (``LAUNCHER_PID_ENV``), whose torchrun it is, it also leaves at once if torchrun or the
    launcher died before that took effect (a second Ctrl-C, a launcher killed, while the ranks import):
    its parent is then no longer a child of the launcher, and the rank lived on, orphaned, retrying the
    dead torchrun's store."""
    die_with_parent()
    launcher = os.environ.get(LAUNCHER_PID_ENV, "")
    if not launcher.isdigit():
        return
    grandparent = parent_of(os.getppid())
    if grandparent is not None and grandparent != int(launcher):
        os._exit(1)


def parent_of(pid: int) -> int | None:
    """The pid of ``pid``'s parent (Linux's /proc), or None where it cannot be read (gone, elsewhere)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


class LoaderWorkerInit:
    """A DataLoader ``worker_init_fn`` for a rank's workers, which leave stopping to their rank: a SIGINT or
    SIGTERM sent to the whole process tree (a terminal's Ctrl-C, ``timeout``, systemd, Slurm) reaches them
    too, and torch's workers die of a SIGTERM their rank did not send, so that the rank failed mid-step
    where it should have stopped after it with a checkpoint. They ignore both; their rank ends them
    (:func:`end_workers`), and Linux kills them if it dies. ``then``: called next with the worker's id (the
    cores of a pinned rank's workers), or None."""

    def __init__(self, then: Callable[[int], None] | None = None) -> None:
        self.then = then
        self.rank_pid = os.getpid()  # made in the rank, called in its workers

    def __call__(self, worker_id: int) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)  # discards one that came while held (stop_signals_held)
        release_stop_signals()
        if os.getppid() == self.rank_pid:  # forked by the rank (not by a forkserver, Python 3.14's default)
            die_with_parent(self.rank_pid)
        if self.then is not None:
            self.then(worker_id)


def start_holding_stop_signals(parent: int) -> None:
    """The ``preexec_fn`` of tandem train's torchrun: it dies with its launcher (``parent``'s pid, see
    :func:`die_with_parent`) and SIGINT and SIGTERM stay blocked in it and, as the mask is inherited, in
    its workers until they take them (:meth:`StopRequests.install`, :func:`release_stop_signals`). The
    launcher passes a first signal on to the workers and kills torchrun at a second; a signal sent to
    every process of the run (systemd, Slurm's scancel, ``kill`` of each pid) made torchrun end with a
    traceback and terminate the workers, killing them 30 s later whatever they were writing. A worker
    that gets one before it takes them (still importing) stops after its first step where it died."""
    die_with_parent(parent)
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def release_stop_signals() -> None:
    """Let SIGINT and SIGTERM through in this thread; one held back (see
    :func:`start_holding_stop_signals`) is delivered now."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM held back (blocked) in this thread while the block runs; one that came meanwhile
    is delivered when the block ends. Processes forked meanwhile start with them held: torch's DataLoader
    workers install a SIGTERM handler of their own (which dies of a SIGTERM not sent by their rank) before
    :class:`LoaderWorkerInit` ignores the signals and lets them through, and a SIGTERM to the whole tree
    in between killed a worker as the rank started it (or left a worker the rank waited for at exit)."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def end_workers(batches: Iterator) -> None:
    """End the DataLoader workers of the iterator ``batches`` (no-op for others): asked to finish, then
    killed if still there. Workers started with :class:`LoaderWorkerInit` ignore the SIGTERM with which
    multiprocessing ends them at the interpreter's exit, so a rank must end them before it exits."""
    workers = list(getattr(batches, "_workers", ()))
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()  # the end-of-work message, a join, and torch forgets their pids (its SIGCHLD check)
    for w in workers:
        if w.is_alive():  # still busy after the join's timeout: terminate() would be ignored
            w.kill()
            w.join()


class Background:
    """``compute()`` in a daemon thread of its own, while the thread that made this goes on: it gets the
    signals (Python runs handlers in the main thread only, so a Ctrl-C never lands inside ``compute``) and
    can take part in collectives meanwhile. :attr:`done`, then :meth:`result`.

    Example::

        >>> work = Background(check_manifests, "tandem-check")
        >>> while not work.done:
        ...     work.wait(0.1)
        >>> problem = work.result()
    """

    def __init__(self, compute: Callable[[], object], name: str) -> None:
        self._outcome: list[tuple[bool, object]] = []
        self._thread = threading.Thread(target=self._run, args=(compute,), name=name, daemon=True)
        self._thread.start()

    def _run(self, compute: Callable[[], object]) -> None:
        try:
            self._outcome.append((True, compute()))
        except BaseException as e:  # raised again by result(), in the caller's thread
            self._outcome.append((False, e))

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def result(self) -> object:
        """What ``compute()`` returned, once it has (or the exception it raised, raised here)."""
        self._thread.join()
        ok, value = self._outcome[0]
        if not ok:
            raise value  # type: ignore[misc]
        return value
