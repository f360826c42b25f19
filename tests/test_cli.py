"""The command line: `tandem`, `python -m tandem`, `python -m benchmarks.run`, in-process and spawned."""

from __future__ import annotations

import importlib.util
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tandem.bench import runner
from tandem.bench.registry import REGISTRY, OpBench, Shape, register
from tandem.cli.main import main

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src"


def _python(*args: str) -> subprocess.CompletedProcess[str]:
    """``python <args>`` from the repository root, with src/ on the path (works with or without install)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def test_import_tandem_leaves_torch_dynamo_to_first_use():
    """torch._dynamo (~0.7 s of a ~1.7 s import here) waits for what needs it: torch.compile, an optimizer,
    a custom op's first call (torch's dispatch imports it). `tandem train`'s launcher, which runs none of
    them, starts its ranks that much sooner."""
    done = _python("-c", "import sys, tandem; print('torch._dynamo' in sys.modules)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


@pytest.fixture
def fake_op():
    """A tiny two-provider op in the registry for one test; the registry is restored afterwards."""
    runner.discover()  # real bench modules register now, so restoring the snapshot never loses them
    saved = dict(REGISTRY)

    def matmul(n):
        def factory(params, device, mode):
            a = torch.randn(n, n, device=device)
            return lambda: a @ a

        return factory

    register(
        OpBench(
            "fake_cli",
            {"torch": matmul(48), "tandem": matmul(32)},
            (Shape("small", {}, quick=True), Shape("big", {})),
            description="matmul",
        )
    )
    yield "fake_cli"
    REGISTRY.clear()
    REGISTRY.update(saved)


@pytest.mark.parametrize(
    "args, expected",
    [
        pytest.param(["-m", "tandem", "--help"], ["train", "bench"], id="tandem"),
        pytest.param(
            ["-m", "tandem", "bench", "--help"], ["--quick", "--csv", "--plot", "--threads"], id="bench"
        ),
        pytest.param(["-m", "benchmarks.run", "--help"], ["--op", "--quick"], id="benchmarks.run"),
    ],
)
def test_help_as_a_process(args, expected):
    done = _python(*args)
    assert done.returncode == 0, done.stderr
    for word in expected:
        assert word in done.stdout


def test_bench_table_csv_and_plot(fake_op, tmp_path, capsys):
    csv_path, png_path = tmp_path / "b.csv", tmp_path / "b.png"
    argv = ["bench", "--op", fake_op, "--device", "cpu", "--threads", "1", "--min-time", "0.02"]
    argv += ["--csv", str(csv_path)]
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    if has_mpl:
        argv += ["--plot", str(png_path)]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "command: tandem bench --op fake_cli" in out
    assert "speedup" in out and "1.00x" in out and "small" in out and "big" in out
    assert "[2/2] fake_cli big train tandem" in err  # cases, not rows
    lines = csv_path.read_text().splitlines()
    assert lines[0] == ",".join(runner.CSV_COLUMNS) and len(lines) == 5
    if has_mpl:
        assert png_path.read_bytes()[:4] == b"\x89PNG"


def test_bench_outputs_that_cannot_be_written_are_one_line_each(fake_op, tmp_path, capsys, monkeypatch):
    """Standard output that fails (``> /dev/full``) and a CSV that cannot be written after the timing (a disk
    that filled): tracebacks after the measurements; now one line each and status 1, the rest written."""
    import errno

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    csv_path = tmp_path / "b.csv"
    monkeypatch.setattr(runner, "write_csv", full)
    argv = [
        "bench",
        "--op",
        fake_op,
        "--quick",
        "--threads",
        "1",
        "--min-time",
        "0.02",
        "--csv",
        str(csv_path),
    ]
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert "speedup" in out and f"tandem bench: error: --csv {csv_path}: not written (No space left" in err
    monkeypatch.undo()
    done = subprocess.run(
        f"{shlex.quote(sys.executable)} -m tandem bench --list > /dev/full", shell=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(SRC)}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip() == "tandem bench: error: writing to standard output: No space left on device"


def test_bench_with_standard_output_closed_writes_its_csv(fake_op, tmp_path, capsys, monkeypatch):
    """``>&-`` (sys.stdout None): the table's flush raised AttributeError after all the timing, and the
    --csv asked for was never written; the table goes nowhere now, the CSV is written."""
    csv_path = tmp_path / "b.csv"
    monkeypatch.setattr(sys, "stdout", None)
    argv = ["bench", "--op", fake_op, "--quick", "--threads", "1", "--min-time", "0.02"]
    assert main([*argv, "--csv", str(csv_path)]) == 0
    assert len(csv_path.read_text().splitlines()) == 3  # header, torch's row and tandem's
    assert f"wrote 2 rows to {csv_path}" in capsys.readouterr().err


def test_a_standard_stream_closed_at_the_start_is_the_null_device_for_children_too(tmp_path):
    """``tandem ... 2>&-``: descriptor 2 gets the null device, inheritable as a standard stream is, so that
    torchrun's workers start with it too (os.open's descriptor is not inherited: they started with 2
    closed, and a file they opened took the number)."""
    child = "import os; os.fstat(2); print('open')"
    code = (
        "import subprocess, sys\n"
        "from tandem.cli.main import _null_for_closed_standard_streams\n"
        "_null_for_closed_standard_streams()\n"
        "print('error' if sys.stderr is None else 'stderr', flush=True)\n"
        f"subprocess.run([sys.executable, '-c', {child!r}])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run(
        ["sh", "-c", '"$@" 2>&-', "sh", sys.executable, "-c", code],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.stdout.split() == ["stderr", "open"], done.stdout


def test_bench_quick(fake_op, capsys):
    assert main(["bench", "--op", fake_op, "--quick", "--threads", "1", "--min-time", "0.02"]) == 0
    out, _ = capsys.readouterr()
    assert "small" in out and "big" not in out


def test_bench_list(fake_op, capsys):
    assert main(["bench", "--list", "--op", fake_op]) == 0
    out, _ = capsys.readouterr()
    assert "providers: torch (baseline), tandem" in out and "small  [quick, cpu, cuda]" in out


@pytest.mark.parametrize("command", ["train", "transcribe", "bench"])
def test_an_unknown_option_is_refused_in_the_subcommands_usage(command, capsys):
    """``tandem train --bogus`` printed the top-level usage (``tandem [-h] [--version] {train,...}``) and
    "tandem: error", which names no option of train's."""
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--bogus", *(["a.wav"] if command == "transcribe" else [])])  # (its FILE given)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith(f"usage: tandem {command} ")
    assert err.rstrip().endswith(f"tandem {command}: error: unrecognized arguments: --bogus")


@pytest.mark.parametrize(
    "argv, message",
    [
        pytest.param([], "the following arguments are required", id="no-command"),
        pytest.param(
            ["bench", "--threads", "0"],
            "--threads: expected a thread count from 1 to 4096, got 0",
            id="threads0",
        ),
        pytest.param(["bench", "--min-time", "-1"], "--min-time: expected a positive number", id="min-time"),
        pytest.param(["bench", "--device", "tpu"], "invalid choice: 'tpu'", id="device"),
        pytest.param(["bench", "--op", "nope"], "unknown op 'nope'; available: ", id="unknown-op"),
        pytest.param(
            ["train", "--hidden", "0"], "--hidden: expected a positive integer, got 0", id="hidden0"
        ),
        # an empty name is the current folder to pathlib: --csv "" was ignored, --model "" named "."
        pytest.param(["bench", "--csv", ""], "--csv: expected a path, got ''", id="csv-empty"),
        pytest.param(
            ["transcribe", "--model", "", "a.wav"], "--model: expected a path, got ''", id="model-empty"
        ),
        pytest.param(
            ["bench", "--threads", "99999999999"],
            "--threads: expected a thread count from 1 to 4096",
            id="threads",
        ),
    ],
)
def test_bad_arguments_exit_2_with_a_message(fake_op, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "case, message",
    [
        ("same-file", "--csv and --plot name the same file"),
        ("list-with-outputs", "--list times nothing: --csv, --plot, --min-time would have no effect"),
        ("nothing-to-time", "--op fake_cli: nothing to time on cpu (no shape of theirs runs there"),
    ],
)
def test_bench_options_that_would_write_or_time_nothing_exit_2_and_write_nothing(
    fake_op, tmp_path, capsys, case, message
):
    """--csv and --plot on one file (the chart replaced the rows), --list with options it ignores (in
    silence), an op without a shape for the device (exit 0 and a CSV of its header alone)."""
    out = tmp_path / "x.png"
    argv = {
        "same-file": ["bench", "--op", fake_op, "--csv", str(out), "--plot", str(out)],
        "list-with-outputs": ["bench", "--list", "--csv", str(out), "--plot", str(out), "--min-time", "5"],
        "nothing-to-time": ["bench", "--op", fake_op, "--device", "cpu", "--csv", str(tmp_path / "b.csv")],
    }[case]
    if case == "nothing-to-time":
        for shape in REGISTRY[fake_op].shapes:
            object.__setattr__(shape, "devices", ("cuda",))
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_bench_checks_outputs_before_timing(fake_op, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--op", fake_op, "--csv", str(tmp_path / "missing" / "b.csv")])
    err = capsys.readouterr().err
    assert "--csv: directory" in err and "does not exist" in err and "[1/" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_bench_cuda_without_cuda(fake_op, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--op", fake_op, "--device", "cuda"])
    assert "CUDA is not available" in capsys.readouterr().err


_INTERRUPTED_CHECK = """
import sys, time
from tandem.cli import train as cli_train
from tandem.cli.main import main

def check(args):  # takes in a KeyboardInterrupt, as soundfile's C callbacks did when the check read files
    open(sys.argv[1], "w").close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            time.sleep(0.05)
        except KeyboardInterrupt:
            return "--train-manifest: a good file blamed"
    return None

cli_train._check_task_options = check
sys.exit(main(["train", "--nproc", "1", "--out", sys.argv[2]]))
"""


def test_train_interrupted_while_its_arguments_are_checked_says_so_and_writes_nothing(tmp_path):
    """Ctrl-C while a long manifest is checked (before launch): one line and status 130, at once, no
    traceback. The check runs in a thread of its own: the KeyboardInterrupt, raised inside soundfile's C
    callbacks, blamed a good file, was lost (the run trained on) or once crashed the launcher."""
    started, out = tmp_path / "started", tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(SRC), os.environ.get("PYTHONPATH")))))
    proc = subprocess.Popen(
        [sys.executable, "-c", _INTERRUPTED_CHECK, str(started), str(out)],
        env=env, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        signalled = time.monotonic()
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait(10)
    assert proc.returncode == 130, err
    assert time.monotonic() - signalled < 5  # not after the check's 10 s
    assert "interrupted while checking the arguments; nothing was written" in err and "blamed" not in err
    assert "Traceback" not in err and not out.exists()
