"""Running ``tandem train`` as a user does, from the tests: processes started, watched and always ended."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
# The tests train on the CPU with Gloo, as CI does, on a machine with a GPU too (where `--device auto`
# would pick CUDA, one process per GPU). A test's own --device, later on the command line, wins.
ON_CPU = ("--device", "cpu")


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def env(pythonpath: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment with this checkout's src/ (and ``pythonpath`` before it) on the path."""
    path = [*pythonpath, str(SRC), os.environ.get("PYTHONPATH")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))


def tandem(
    *args: str,
    timeout: float = 300,
    pythonpath: tuple[str, ...] = (),
    cwd: Path | None = None,
    extra_env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """``tandem train ARGS`` to its end (in ``cwd``, with ``extra_env`` added to the environment)."""
    return subprocess.run(
        [sys.executable, "-m", "tandem", "train", *ON_CPU, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(env(pythonpath), **(extra_env or {})),
        cwd=cwd,
    )


def tandem_in_process(*args: str) -> int:
    """``tandem train ARGS`` in this process, its exit status: for refusals, which end before anything
    starts (a process of its own takes ~1.5 s, most of it importing tandem). Read its output with
    ``capsys``, which leaves the CLI's stream wrappers out (they wrap streams with a file descriptor)."""
    from tandem.cli.main import main

    try:
        return main(["train", *ON_CPU, *args])
    except SystemExit as e:  # argparse's errors
        return e.code


def start(*args: str, log: Path) -> subprocess.Popen:
    """``tandem train ARGS`` in the background (its own session), output to ``log``."""
    with open(log, "w") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "tandem", "train", *ON_CPU, *args],
            stdout=f, stderr=subprocess.STDOUT, env=env(), start_new_session=True,
        )  # fmt: skip


def processes_mentioning(text: str, env_entry: str | None = None) -> list[int]:
    """Live processes whose command line contains ``text`` (and whose environment has ``env_entry``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if text not in (entry / "cmdline").read_bytes().decode(errors="replace"):
                continue
            if env_entry is not None and env_entry.encode() not in (entry / "environ").read_bytes().split(
                b"\0"
            ):
                continue
        except OSError:
            continue
        pids.append(int(entry.name))
    return pids


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 180) -> None:
    """Until ``path`` exists; fails if ``proc`` ends first or the time runs out."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, (
            f"tandem train ended (status {proc.returncode}) before {path.name} existed"
        )
        assert time.monotonic() < deadline, f"no {path.name} within {timeout} s"
        time.sleep(0.05)


def finish(proc: subprocess.Popen, out: Path, timeout: float = 180) -> int:
    """Wait for ``proc``; then make sure nothing of its run (launcher, torchrun, workers) is left."""
    try:
        return proc.wait(timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for pid in processes_mentioning(str(out)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
