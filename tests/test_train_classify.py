"""``tandem train --task classify`` (Japanese Vowels) end to end: real processes through torchrun, Gloo on
127.0.0.1, bounded in time."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import numpy as np
import pytest
import torch

from asr._cli import ON_CPU, env, free_port, tandem, tandem_in_process


def _tandem(
    *args: str, timeout: float = 240, pythonpath: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """``tandem train --task classify ARGS`` to its end, as tests/asr/_cli.py runs the speech task (on the
    CPU, this checkout's src/ on the path)."""
    return tandem("--task", "classify", *args, timeout=timeout, pythonpath=pythonpath)


SMALL = ("--hidden", "16", "--layers", "1", "--batch-size", "32")


def test_two_processes_learn_and_write_their_files(tmp_path):
    out = tmp_path / "run"
    done = _tandem("--nproc", "2", "--epochs", "3", "--out", str(out), *SMALL, "--master-port", free_port())
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["epochs"] == 3 and len(metrics["history"]) == 3
    assert metrics["test_accuracy"] > 0.5, metrics  # chance is 1/9
    assert metrics["train_seconds"] > 0
    assert (out / "training_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert torch.load(out / "checkpoint.pt", weights_only=True)["epoch"] == 3
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "temporary files left behind"


def test_resumed_run_ends_with_the_uninterrupted_weights(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = ("--nproc", "2", *SMALL)
    first = _tandem(*common, "--epochs", "3", "--out", str(straight), "--master-port", free_port())
    assert first.returncode == 0, first.stderr[-3000:]
    part = _tandem(*common, "--epochs", "2", "--out", str(resumed), "--master-port", free_port())
    assert part.returncode == 0, part.stderr[-3000:]
    rest = _tandem(*common, "--epochs", "3", "--resume", "--out", str(resumed), "--master-port", free_port())
    assert rest.returncode == 0, rest.stderr[-3000:]
    a = torch.load(straight / "checkpoint.pt", weights_only=True)
    b = torch.load(resumed / "checkpoint.pt", weights_only=True)
    assert a["epoch"] == b["epoch"] == 3
    for name, tensor in a["model"].items():
        torch.testing.assert_close(b["model"][name], tensor, rtol=0, atol=0, msg=name)
    assert [h["test_accuracy"] for h in a["history"]] == [h["test_accuracy"] for h in b["history"]]
    # fewer epochs than trained: refused, as the speech task refuses it (it rewrote metrics.json with the
    # 3 epochs' history and said it wrote checkpoint.pt); as many: nothing to train, no checkpoint written
    metrics = (resumed / "metrics.json").read_bytes()
    again = ("--resume", "--out", str(resumed), "--master-port", free_port())
    fewer = _tandem(*common, "--epochs", "2", *again)
    assert fewer.returncode == 2, fewer.stderr[-3000:]
    assert "--epochs 2: the checkpoint has trained 3 epochs; resume with --epochs 3 or more" in fewer.stderr
    assert (resumed / "metrics.json").read_bytes() == metrics
    # without --epochs: the run's own 3 (the task's default, 20, trained on)
    same = _tandem(*common, "--resume", "--out", str(resumed), "--master-port", free_port())
    last = same.stdout.splitlines()[-1]
    assert same.returncode == 0 and last.startswith("done:") and "checkpoint.pt" not in last, last


def test_without_matplotlib_the_closing_line_names_only_what_was_written(tmp_path):
    blocker = tmp_path / "no-mpl" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('matplotlib is blocked for this test')\n")
    out = tmp_path / "run"
    args = ("--nproc", "1", "--epochs", "1", "--out", str(out), *SMALL)
    done = _tandem(*args, timeout=120, pythonpath=(str(blocker.parent),))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "matplotlib is not installed" in done.stdout
    assert done.stdout.splitlines()[-1].endswith(f"wrote checkpoint.pt, metrics.json to {out}")
    assert not (out / "training_curve.png").exists()


def test_an_earlier_runs_files_are_set_aside_not_overwritten(tmp_path):
    """A classifier trained into a folder that holds an earlier run (a speech recognizer's, here) moves
    that run's files into previous/, as tandem train's speech task does, instead of overwriting them."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(b"an earlier run's")
    (out / "metrics.json").write_text('{"task": "asr"}')
    partial = out / ".checkpoint.pt.tmp-99999"  # left by a process killed mid-write: removed
    partial.write_bytes(b"half a checkpoint")
    done = _tandem("--nproc", "1", "--epochs", "1", "--out", str(out), *SMALL)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"moved to {out / 'previous'}" in done.stdout
    assert (out / "previous" / "checkpoint.pt").read_bytes() == b"an earlier run's"
    assert (out / "previous" / "metrics.json").read_text() == '{"task": "asr"}'
    assert json.loads((out / "metrics.json").read_text()) != {"task": "asr"}
    assert not partial.exists() and not (out / "previous" / partial.name).exists()


def test_single_process_matches_no_torchrun(tmp_path):
    done = _tandem("--nproc", "1", "--epochs", "1", "--out", str(tmp_path / "one"), *SMALL)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "one" / "metrics.json").read_text())["world_size"] == 1


def test_malformed_data_is_a_clear_error_and_writes_nothing(tmp_path):
    bad = tmp_path / "bad.npz"
    np.savez(
        bad,
        features=np.ones((4, 3, 2), np.float32),
        lengths=np.array([3, 1, 2, 9]),
        labels=np.zeros(4, np.int64),
    )
    out = tmp_path / "out"
    done = _tandem("--data", str(bad), "--out", str(out), timeout=60)
    assert done.returncode == 2
    assert "lengths in [1, 3]" in done.stderr and str(bad) in done.stderr
    assert not out.exists()


def test_data_that_would_break_training_is_refused_before_it_starts(tmp_path):
    """Values load_npz took that broke training later: features beyond float32's range (NaN loss after an
    earlier run was set aside), labels past int64 (wrapped negative) or far above the others (an output
    layer of 10**9 classes); and fewer train or test sequences than processes (a hang, then tracebacks)."""
    from tandem.data import load_npz

    def data(features=None, labels=None, n=6) -> str:
        path = tmp_path / "d.npz"
        split = np.arange(n) % 2
        feats = np.ones((n, 3, 2)) if features is None else features
        np.savez(
            path,
            features=feats,
            lengths=np.full(n, 3),
            labels=np.zeros(n, np.int64) if labels is None else labels,
            split=split,
        )
        return str(path)

    for kwargs, message in (
        ({"features": np.full((6, 3, 2), 1e300)}, "expected finite float32 features"),
        ({"labels": np.full(6, 2**63 + 5, np.uint64)}, "expected labels from 0 to 1048575"),
        ({"labels": np.array([0, 1, 10**9, 0, 1, 0])}, "expected labels from 0 to 1048575"),
    ):
        with pytest.raises(ValueError, match=message):
            load_npz(data(**kwargs))
    out = tmp_path / "out"
    done = _tandem("--nproc", "2", "--data", data(n=2), "--out", str(out), timeout=60)
    assert done.returncode == 2 and "1 train sequence(s) for 2 processes" in done.stderr, done.stderr
    assert not out.exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_out_is_a_clear_error(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    done = _tandem("--out", str(locked / "run"), timeout=60)
    assert done.returncode == 2 and "--out" in done.stderr


def test_out_that_cannot_be_written_is_named_with_the_reason(tmp_path, monkeypatch):
    """What the test above checks where it can (not as root, who writes anywhere): the check of --out says
    which folder and why, and writes nothing."""
    import errno
    import tempfile

    from tandem.cli.train import _check_out

    def refused(*args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", refused)
    out = tmp_path / "run"
    assert _check_out(out, resume=False) == f"--out {out}: cannot write there (Permission denied)"
    assert list(out.iterdir()) == []


def test_out_that_is_a_file_is_a_clear_error(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    done = _tandem("--out", str(target), timeout=60)
    assert done.returncode == 2 and "expected a folder" in done.stderr
    assert target.read_text() == "x"


@pytest.mark.parametrize(
    "args, message",
    [
        (("--nproc", "0"), "--nproc"),
        (("--epochs", "-1"), "--epochs"),
        (("--master-port", "70000"), "--master-port: expected a port from 1 to 65535, got 70000"),
        # the speech task's options were taken and ignored, invalid ones too
        (
            ("--warmup-steps", "-5", "--augment", "on", "--conv-channels", "7"),
            "--augment, --warmup-steps, --conv-channels: only for --task asr",
        ),
        (("--seed", str(10**15)), "--seed: expected a seed from 0 to 4294967295"),
    ],
)
def test_bad_numbers_are_argparse_errors(tmp_path, capsys, args, message):
    """In this process: a refusal ends before anything starts (tests/asr runs one through the command)."""
    out = tmp_path / "out"
    assert tandem_in_process("--task", "classify", *args, "--out", str(out)) == 2
    assert message in capsys.readouterr().err and not out.exists()


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
    done = _tandem("--resume", "--out", str(tmp_path / "empty"), timeout=60)
    assert done.returncode == 2 and "expected a checkpoint" in done.stderr


def test_a_diverged_loss_ends_the_run_once_with_a_message(tmp_path):
    """Finite features near float32's limit overflow the first gradients: the loss becomes NaN on every
    rank at once. The run ends with status 1 and one message, not a traceback and three torchrun
    restarts into the same loss."""
    data = tmp_path / "huge.npz"
    rng = np.random.default_rng(0)
    features = (rng.standard_normal((64, 5, 3)) * 3e38).clip(-3.3e38, 3.3e38).astype(np.float32)
    np.savez(data, features=features, lengths=np.full(64, 5), labels=rng.integers(0, 3, 64))
    out = tmp_path / "out"
    args = ("--data", str(data), "--nproc", "2", "--epochs", "2", "--hidden", "8", "--layers", "1")
    done = _tandem(*args, "--out", str(out), "--master-port", free_port(), timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "tandem train: error: the loss became nan in epoch 1" in done.stderr
    assert done.stdout.count("tandem train: GRU") == 1, "torchrun restarted the ranks"
    assert "Traceback" not in done.stderr and "training processes failed" not in done.stderr


def test_a_full_disk_stops_the_run_with_a_clear_error_and_no_restarts(tmp_path):
    """A limit on file sizes fails the first checkpoint's write (EFBIG, as a full disk's ENOSPC would):
    the ranks end together with one line naming the file, not rank 0's traceback and torchrun restarting
    the group into the same disk, training from the start each time (as the speech task ends)."""
    out = tmp_path / "run"
    limit = 4 * 1024  # the checkpoint of SMALL's model is ~20 kB

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    command = ["train", "--task", "classify", *ON_CPU, "--nproc", "2", *SMALL, "--epochs", "2"]
    done = subprocess.run(
        [sys.executable, "-m", "tandem", *command, "--out", str(out), "--master-port", free_port()],
        capture_output=True, text=True, timeout=240, env=env(), preexec_fn=small_files,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    assert "tandem train: error: the checkpoint after epoch 1: " in done.stderr, done.stderr[-3000:]
    assert "checkpoint.pt: not written" in done.stderr
    assert "make room, then run the same command" in done.stderr and "--resume" not in done.stderr  # none
    assert "Traceback" not in done.stderr and done.stdout.count("tandem train: GRU") == 1, done.stderr[-3000:]
    assert not list(out.glob("*.pt")) and not list(out.glob(".*tmp*"))


def test_metrics_that_cannot_be_written_are_a_clear_error_after_the_last_checkpoint(tmp_path):
    out = tmp_path / "run"
    (out / "metrics.json").mkdir(parents=True)  # the rename onto it fails, as a full disk's write would
    done = _tandem("--nproc", "2", *SMALL, "--epochs", "1", "--out", str(out), "--master-port", free_port())
    assert done.returncode == 1, done.stderr[-3000:]
    assert f"tandem train: error: {out / 'metrics.json'}: not written (" in done.stderr, done.stderr[-3000:]
    assert "the run is done and wrote checkpoint.pt to" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout.count("tandem train: GRU") == 1
    assert torch.load(out / "checkpoint.pt", weights_only=True)["epoch"] == 1


def test_resume_with_other_settings_is_a_clear_error(tmp_path):
    out = tmp_path / "out"
    first = _tandem("--nproc", "1", "--epochs", "1", *SMALL, "--out", str(out))
    assert first.returncode == 0, first.stderr[-3000:]
    done = _tandem("--nproc", "2", "--epochs", "2", *SMALL, "--out", str(out), "--resume", timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    message = "--resume: the run's settings differ from the checkpoint's (processes (--nproc x --nnodes): "
    message += "checkpoint 1, now 2)"  # (it named the setting's key, world_size)
    assert done.stderr.count(message) == 1, done.stderr[-3000:]  # once: one launch, no restarts
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("world", [1, 2])
def test_a_finished_rank_leaves_without_interpreter_shutdown(world, monkeypatch):
    """A rank of a multi-process run ends with os._exit after destroying its group and flushing (see
    ``Group.leave``: a Gloo worker thread could abort the process during interpreter shutdown); a
    single process returns normally."""
    from tandem.asr import distributed
    from tandem.cli import _train_worker

    calls = []
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "destroy_process_group", lambda: calls.append("destroy"))
    monkeypatch.setattr(distributed.os, "_exit", lambda code: calls.append(("exit", code)))
    monkeypatch.setattr(_train_worker, "_train", lambda args, device, grp, threads: 3)
    group = object.__new__(distributed.Group)  # a group without init_process_group
    group.world, group.rank, group.local_world = world, 0, world
    monkeypatch.setattr(_train_worker, "Group", lambda device, timeout: group)
    args = type("Args", (), {"device": "cpu", "timeout": 5.0, "threads": 1})()
    assert _train_worker.train(args) == 3
    assert calls == (["destroy", ("exit", 3)] if world == 2 else [])


def test_resume_from_a_file_that_is_no_classify_checkpoint_is_one_error(tmp_path):
    """A truncated file, or a speech-recognition checkpoint: one line and status 2, not a traceback on
    every rank and torchrun's restarts into it."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(b"PK\x03\x04 truncated")
    args = ("--nproc", "2", "--epochs", "1", "--hidden", "8", "--layers", "1", "--resume")
    done = _tandem(*args, "--out", str(out), "--master-port", free_port(), timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    expected = f"tandem train: error: --resume: {out / 'checkpoint.pt'}: not a readable checkpoint (truncated"
    assert expected in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and done.stdout.count("tandem train: GRU") <= 1


@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory):
    """A finished 1-epoch run of one process: its checkpoint to damage."""
    out = tmp_path_factory.mktemp("one_epoch") / "run"
    done = _tandem("--nproc", "1", "--epochs", "1", *SMALL, "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.parametrize("case", ["changed-in-place", "incomplete"])
def test_resume_from_a_damaged_or_incomplete_checkpoint_is_one_error(tmp_path, one_epoch, case):
    """A checkpoint whose bytes changed in place (a bad disk, a copy gone wrong) was resumed from, its
    changed weights taken as numbers; one without its history ended in a KeyError traceback. Both are
    refused as the speech task refuses them."""
    out = tmp_path / "out"
    out.mkdir()
    path = out / "checkpoint.pt"
    state = torch.load(one_epoch / "checkpoint.pt", weights_only=True)
    if case == "incomplete":
        del state["history"]
        torch.save(state, path)
    else:  # the first weight's first value changed in the file, its archive's checksum not
        data = (one_epoch / "checkpoint.pt").read_bytes()
        weight = next(iter(state["model"].values())).numpy()
        at = data.index(weight.tobytes())
        path.write_bytes(data[:at] + (weight.flat[0] + 1).tobytes() + data[at + weight.itemsize :])
    done = _tandem("--nproc", "1", "--epochs", "2", *SMALL, "--out", str(out), "--resume", timeout=120)
    expected = {
        "changed-in-place": "a corrupt checkpoint (",
        "incomplete": "incomplete checkpoint, missing ['history']",
    }[case]
    assert done.returncode == 2 and f"--resume: {path}: {expected}" in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("to", ["launcher", "every process"])
def test_a_sigterm_stops_the_run_at_once_with_status_130(tmp_path, to):
    """The classifier's ranks die of a SIGINT or SIGTERM (Python's default): passed on by the launcher
    alone, torchrun restarted them and the run trained to its end with status 0. The launcher ends
    everything at once now and exits 130; nothing is left running."""
    import signal
    import time

    from asr._cli import finish, processes_mentioning, start, wait_for

    out = tmp_path / "run"
    args = ("--task", "classify", "--nproc", "2", "--epochs", "10000", *SMALL, "--out", str(out))
    proc = start(*args, "--master-port", free_port(), log=tmp_path / "log")
    try:
        wait_for(out / "checkpoint.pt", proc)
        for pid in [proc.pid] if to == "launcher" else processes_mentioning(str(out)):
            os.kill(pid, signal.SIGTERM)
        code = proc.wait(60)
        deadline = time.monotonic() + 30
        while processes_mentioning(str(out)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not processes_mentioning(str(out))
    finally:
        finish(proc, out)
    log = (tmp_path / "log").read_text()
    assert code == 130, log[-3000:]
    assert "done:" not in log and "SIGTERM: stopping at once" in log, log[-3000:]


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_one_process_stopped_by_a_signal_says_so_with_status_130(tmp_path, sig):
    """One process, no launcher: Ctrl-C printed a KeyboardInterrupt traceback, and a SIGTERM killed it
    silently with status 143; it stops at once with one line and 130, as under the launcher, and the
    checkpoint of its last finished epoch stays."""
    import signal

    from asr._cli import finish, start, wait_for

    out = tmp_path / "run"
    proc = start("--task", "classify", "--nproc", "1", "--epochs", "10000", *SMALL, "--out", str(out),
                 log=tmp_path / "log")  # fmt: skip
    try:
        wait_for(out / "checkpoint.pt", proc)
        proc.send_signal(getattr(signal, sig))
        code = proc.wait(60)
    finally:
        finish(proc, out)
    log = (tmp_path / "log").read_text()
    assert code == 130 and f"tandem train: {sig}: stopping at once" in log, log[-3000:]
    assert "Traceback" not in log and "done:" not in log
    torch.load(out / "checkpoint.pt", weights_only=True)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("stdout", ["full-disk", "closed-pipe", "both-closed-pipe"])
def test_a_standard_output_that_fails_loses_the_messages_not_the_run(tmp_path, stdout):
    """``tandem train > /dev/full``, ``| head -1`` or ``2>&1 | head -1``: rank 0's first message raised, and
    both ranks ended in tracebacks with nothing written. The run goes on, says so once on stderr (where
    stderr still works), and writes its files."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "tandem", "train", *ON_CPU, "--task", "classify", "--nproc", "2"]
    cmd += ["--epochs", "2", "--out", str(out), *SMALL, "--master-port", free_port()]
    both = stdout == "both-closed-pipe"
    with open("/dev/full", "w") as full:
        proc = subprocess.Popen(
            cmd,
            stdout=full if stdout == "full-disk" else subprocess.PIPE,
            stderr=subprocess.STDOUT if both else subprocess.PIPE,
            env=env(),
        )
    if proc.stdout is not None:
        proc.stdout.close()  # the reader is gone before the first line
    try:
        _, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    err = (err or b"").decode(errors="replace")
    assert proc.returncode == 0, err[-3000:]
    if not both:
        assert err.count("standard output failed") == 1 and "Traceback" not in err, err[-3000:]
    assert json.loads((out / "metrics.json").read_text())["epochs"] == 2
