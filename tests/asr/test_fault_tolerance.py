"""Training that survives failures: a worker killed mid-epoch (torchrun restarts the group, which continues
from its checkpoint), Ctrl-C and --resume, damaged checkpoints, a checkpoint that cannot be written, two
nodes, a node that dies. Every run is compared with an uninterrupted run of the same seed, bit for bit
(Gloo on 127.0.0.1, one thread a process, every wait bounded, every process ended)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _cli import ON_CPU, env, finish, free_port, processes_mentioning, start, tandem, wait_for

from tandem.asr.checkpoint import CheckpointStore, CheckpointWriteError, load_checkpoint

# one epoch of a tiny model (22 steps), a checkpoint every 5 steps; with augmentation (on by default with
# --test-speaker), whose draws a resumed or restarted run must repeat as well
TINY = (
    *("--hidden", "32", "--layers", "1", "--epochs", "1", "--threads", "1", "--checkpoint-every", "5"),
    *("--augment", "on"),
)


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(out / "checkpoint.pt")["model"]


def _scores(out: Path) -> list[tuple]:
    """What metrics.json says of each epoch, less its timings."""
    history = json.loads((out / "metrics.json").read_text())["history"]
    return [(h["epoch"], h["step"], h["train_loss"], h["test_wer"], h["test_cer"]) for h in history]


def _assert_same_run(out: Path, reference: Path) -> None:
    ours, theirs = _weights(out), _weights(reference)
    assert list(ours) == list(theirs)
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0, msg=name)
    assert _scores(out) == _scores(reference)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run everything is compared with: two processes on one node."""
    out = tmp_path_factory.mktemp("reference") / "run"
    done = tandem("--nproc", "2", *TINY, "--out", str(out), "--master-port", free_port())
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _signal_run(tmp_path: Path, signum: int, launcher: bool = False) -> tuple[Path, int, str]:
    """A 2-process run whose rank 1 alone (or its launcher) gets ``signum`` after the first checkpoint:
    (its --out, the launcher's exit status, its log)."""
    out = tmp_path / "run"
    proc = start("--nproc", "2", *TINY, "--out", str(out), "--master-port", free_port(), log=tmp_path / "log")
    try:
        wait_for(out / "checkpoint-00000005.pt", proc)
        (victim,) = [proc.pid] if launcher else processes_mentioning(str(out), "LOCAL_RANK=1")
        os.kill(victim, signum)
    finally:
        code = finish(proc, out)
    return out, code, (tmp_path / "log").read_text()


def test_a_worker_killed_mid_epoch_is_restarted_and_the_run_ends_as_if_not(reference, tmp_path):
    out, code, log = _signal_run(tmp_path, signal.SIGKILL)
    assert code == 0, log[-3000:]
    assert "failed (exitcode: -9)" in log and "resuming at step" in log  # torchrun restarted, we resumed
    _assert_same_run(out, reference)


def test_one_process_given_max_restarts_is_restarted_and_ends_as_if_not(tmp_path):
    """--nproc 1 trains in the launcher's own process, which nothing restarts (README said torchrun
    would); given --max-restarts it runs under torchrun, which restarts it from its checkpoint."""
    single = tmp_path / "single"
    done = tandem("--nproc", "1", *TINY, "--out", str(single))
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "run"
    args = ("--nproc", "1", "--max-restarts", "1", *TINY, "--out", str(out), "--master-port", free_port())
    proc = start(*args, log=tmp_path / "log")
    try:
        wait_for(out / "checkpoint-00000005.pt", proc)
        (rank,) = processes_mentioning(str(out), "LOCAL_RANK=0")
        os.kill(rank, signal.SIGKILL)
    finally:
        code = finish(proc, out)
    log = (tmp_path / "log").read_text()
    assert code == 0, log[-3000:]
    assert "failed (exitcode: -9)" in log and "resuming at step" in log
    _assert_same_run(out, single)


def test_sigint_stops_after_a_checkpoint_and_resume_continues_exactly(reference, tmp_path):
    out = tmp_path / "run"
    args = ("--nproc", "2", *TINY, "--out", str(out), "--master-port", free_port())
    proc = start(*args, log=tmp_path / "log")
    try:
        wait_for(out / "checkpoint-00000005.pt", proc)
        os.kill(proc.pid, signal.SIGINT)  # to the launcher alone, as a terminal's Ctrl-C now reaches it
    finally:
        code = finish(proc, out)
    log = (tmp_path / "log").read_text()
    assert code == 130, log[-3000:]
    assert "stopping after the current step" in log and "stopped by a signal after step" in log
    assert "to continue: tandem train" in log and log.rstrip().endswith("--resume")
    stopped = load_checkpoint(out / "checkpoint.pt")
    stopped_at = stopped["step"]
    assert 5 <= stopped_at < 22 and not (out / "metrics.json").exists()
    assert 0 < stopped["epoch_seconds"] < 60
    # the epoch's seconds before the stop, as if it had been slow: what the resumed epoch's record adds
    torch.save(
        {**torch.load(out / "checkpoint.pt", weights_only=True), "epoch_seconds": 1000.0},
        out / "checkpoint.pt",
    )
    # without --epochs: the run's own 1 (the default, 48, extended the run and changed its schedule)
    given = [a for i, a in enumerate(args) if "--epochs" not in (a, args[i - 1])]
    rest = tandem(*given, "--resume", timeout=120)
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert f"resuming at step {stopped_at}" in rest.stdout
    _assert_same_run(out, reference)
    # the epoch's seconds count its part before the stop (only the resumed part's were counted)
    (epoch,) = json.loads((out / "metrics.json").read_text())["history"]
    assert 1000 < epoch["train_seconds"] < epoch["seconds"] < 1100, epoch
    # a run of another configuration is refused before launch, saying what differs; nothing is touched
    before = sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir())
    other = tandem(*args, "--hidden", "16", "--resume", timeout=120)
    assert other.returncode == 2 and "(--hidden: checkpoint 32, now 16)" in other.stderr
    assert sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir()) == before


def test_sigterm_to_the_launcher_stops_the_run_with_status_130_as_ctrl_c_does(tmp_path):
    """README: Ctrl-C or SIGTERM, exit status 130 (a single process ended so; the launcher said 143)."""
    _, code, log = _signal_run(tmp_path, signal.SIGTERM, launcher=True)
    assert code == 130 and "stopped by a signal after step" in log and "to continue: tandem train" in log, log


def test_a_signal_to_one_worker_stops_the_run_with_status_130(tmp_path):
    """SIGTERM to rank 1 alone (an OOM killer's warning, a cluster's preemption of one process): every rank
    stops after the same step with a checkpoint, and the launcher ends with 130 and says how to continue
    (it once ended with 0, as if the run had finished)."""
    out, code, log = _signal_run(tmp_path, signal.SIGTERM)
    assert code == 130, log[-3000:]
    assert "stopped by a signal after step" in log and "to continue: tandem train" in log
    assert not (out / "metrics.json").exists()


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_sigterm_to_every_process_with_dataloader_workers_stops_the_run(reference, tmp_path, nproc):
    """systemd's stop and Slurm's scancel signal every process of the run, DataLoader workers too. torch's
    workers die of a SIGTERM their rank did not send, and the rank then failed mid-step ("DataLoader worker
    ... is killed by signal", no stop checkpoint, exit 1). The workers leave the stop to their rank now:
    the run stops after a step with a checkpoint, exits 130, leaves no process behind and resumes to
    the uninterrupted run's weights."""
    out = tmp_path / "run"
    args = ("--nproc", nproc, *TINY, "--workers", "2", "--out", str(out), "--master-port", free_port())
    proc = start(*args, log=tmp_path / "log")
    try:
        wait_for(out / "checkpoint-00000005.pt", proc)
        tree = processes_mentioning(str(out))
        assert len(tree) >= 1 + 2 * int(nproc)  # the ranks and their workers (and torchrun)
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        proc.wait(120)
        deadline = time.monotonic() + 30
        while processes_mentioning(str(out)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not processes_mentioning(str(out))
    finally:
        code = finish(proc, out)
    log = (tmp_path / "log").read_text()
    assert code == 130, log[-3000:]
    assert "stopped by a signal after step" in log and "killed by signal" not in log, log[-3000:]
    # torchrun leaves the stop to the launcher and the ranks: no traceback of its SignalException, no
    # SIGTERM of its own (nor its SIGKILL 30 s later) to the ranks writing their checkpoint
    assert "Traceback" not in log and "death signal" not in log, log[-3000:]
    assert 5 <= load_checkpoint(out / "checkpoint.pt")["step"] < 22
    if nproc == "2":  # the reference's world
        rest = tandem(*args, "--resume")
        assert rest.returncode == 0, rest.stderr[-3000:]
        _assert_same_run(out, reference)


_WORKER_SIGNALLED_AT_START = """
import json, os, signal
import torch
from torch.utils.data._utils import signal_handling
from tandem.asr.corpus import load_spoken_digits
from tandem.asr.distributed import Group
from tandem.asr.interrupt import end_workers
from tandem.asr.model import ModelConfig
from tandem.asr.training import Run, TrainConfig, digit_sets

torch_handlers = signal_handling._set_worker_signal_handlers

def then_a_sigterm(*args):  # in each worker: torch's handlers, then a SIGTERM, before its init runs
    torch_handlers(*args)
    os.kill(os.getpid(), signal.SIGTERM)

signal_handling._set_worker_signal_handlers = then_a_sigterm
config = TrainConfig(model=ModelConfig(hidden=8, layers=1, conv_channels=2), epochs=1)
run = Run(config, Group(torch.device("cpu"), 10), digit_sets(load_spoken_digits()))
steps = run.batches(2)
got = [len(next(steps)[0]) for _ in range(3)]
end_workers(steps)
print(json.dumps(got))
"""


def _starting_ranks(out: Path, proc: subprocess.Popen) -> list[int]:
    """The pids of both ranks of the run into ``out``, as soon as they exist (they are importing)."""
    deadline = time.monotonic() + 60
    ranks: list[int] = []
    while len(ranks) < 2:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
        ranks = [pid for r in "01" for pid in processes_mentioning(str(out), f"LOCAL_RANK={r}")]
    return ranks


def test_a_sigterm_to_the_ranks_as_they_start_stops_the_run_after_its_first_step(tmp_path):
    """A signal that reaches the ranks while they import (before they take stop requests) waits for them:
    it killed them, torchrun restarted them, and the run trained to its end (exit 0), the stop lost."""
    out = tmp_path / "run"
    proc = start("--nproc", "2", *TINY, "--out", str(out), "--master-port", free_port(), log=tmp_path / "log")
    try:
        for pid in _starting_ranks(out, proc):
            os.kill(pid, signal.SIGTERM)
    finally:
        code = finish(proc, out)
    log = (tmp_path / "log").read_text()
    assert code == 130, log[-3000:]
    assert "stopped by a signal after step" in log and "failed (exitcode" not in log, log[-3000:]
    assert not (out / "metrics.json").exists()


def test_a_rank_killed_as_the_ranks_start_is_restarted_at_once(reference, tmp_path):
    """torchrun ends the other rank with a SIGTERM before it restarts the group: that one, held while the
    rank imported, was taken for a stop request, and the rank waited for the others' step until torchrun
    killed it 30 s later. It ends at once now, and the restarted group trains the uninterrupted run.
    The folder held an earlier run: rank 0, killed before it set that run aside, came back as a restart,
    which took the earlier run's checkpoints for this launch's (here: trained nothing, said "done"); the
    launcher sets them aside now, before any rank starts."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    args = ("--nproc", "2", *TINY, "--out", str(out), "--master-port", free_port())
    proc = start(*args, log=tmp_path / "log")
    try:
        victim, survivor = _starting_ranks(out, proc)
        time.sleep(0.3)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        while Path(f"/proc/{survivor}").exists() and time.monotonic() - killed < 60:
            if (Path(f"/proc/{survivor}/stat").read_text().rsplit(")", 1)[1].split() or ["Z"])[0] == "Z":
                break
            time.sleep(0.05)
        ended_after = time.monotonic() - killed
    finally:
        code = finish(proc, out)
    log = (tmp_path / "log").read_text()
    assert code == 0 and ended_after < 15, (ended_after, log[-3000:])
    _assert_same_run(out, reference)
    _assert_same_run(out / "previous", reference)  # the earlier run, set aside
    assert "has trained all" not in log, log[-3000:]


_STOPPED_IN_THE_LAST_EVALUATION = """
import os, signal, sys
from tandem.asr import training
from tandem.cli.main import main

evaluate = training.Run.evaluate

def evaluate_with_a_ctrl_c(self, *args, **kwargs):
    if self.epoch >= self.config.epochs:  # the last epoch's evaluation
        os.kill(os.getpid(), signal.SIGINT)
    return evaluate(self, *args, **kwargs)

training.Run.evaluate = evaluate_with_a_ctrl_c
sys.exit(main(["train", *sys.argv[1:]]))
"""


def test_a_stop_in_the_last_epochs_evaluation_finishes_the_run(tmp_path):
    """Ctrl-C while the last epoch was evaluated: the run said "stopped by a signal after step 22 (epoch 2,
    batch 0)" of a 1-epoch run, exit 130, and wrote no metrics.json until a --resume. Nothing is left to
    train: it finishes, says so, and writes its files."""
    out = tmp_path / "run"
    args = (*ON_CPU, "--nproc", "1", *TINY, "--out", str(out))
    driver = [sys.executable, "-c", _STOPPED_IN_THE_LAST_EVALUATION, *args]
    done = subprocess.run(driver, capture_output=True, text=True, timeout=300, env=env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the stop request came after the last step; finishing the run" in done.stderr
    assert json.loads((out / "metrics.json").read_text())["epochs"] == 1


def test_a_second_ctrl_c_as_the_ranks_start_leaves_no_process(tmp_path):
    """The launcher killed torchrun before the ranks had asked to die with it: they lived on, orphaned,
    retrying the dead torchrun's store (minutes). It kills them too, and a rank whose torchrun died
    before it asked leaves by itself (tandem.asr.interrupt.die_with_torchrun)."""
    out = tmp_path / "run"
    proc = start("--nproc", "2", *TINY, "--out", str(out), "--master-port", free_port(), log=tmp_path / "log")
    try:
        _starting_ranks(out, proc)
        os.kill(proc.pid, signal.SIGINT)
        os.kill(proc.pid, signal.SIGINT)
        code = proc.wait(30)
        deadline = time.monotonic() + 20
        while processes_mentioning(str(out)) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = processes_mentioning(str(out))
    finally:
        finish(proc, out)
    assert code == 130 and not left, (code, left)


_DIES_WITH_TORCHRUN = """
import os, subprocess, sys
if sys.argv[1] == "rank":
    from tandem.asr.interrupt import die_with_torchrun
    die_with_torchrun()
    print("alive")
else:  # torchrun, between the launcher (this test) and its rank
    sys.exit(subprocess.call([sys.executable, "-c", sys.argv[2], "rank"]))
"""


@pytest.mark.parametrize("launcher", ["this test", "another process"])
def test_a_rank_whose_torchrun_is_no_child_of_the_launcher_leaves(launcher):
    """Under tandem train's launcher a rank's torchrun is the launcher's child; a rank that finds its
    parent is not (torchrun died, the rank was adopted) leaves at once, status 1."""
    pid = os.getpid() if launcher == "this test" else 1
    done = subprocess.run(
        [sys.executable, "-c", _DIES_WITH_TORCHRUN, "torchrun", _DIES_WITH_TORCHRUN],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(env(), TANDEM_TRAIN_LAUNCHER_PID=str(pid)),
    )
    if launcher == "this test":
        assert done.returncode == 0 and done.stdout == "alive\n", done.stderr
    else:
        assert done.returncode == 1 and done.stdout == "", done.stderr


def test_a_sigterm_as_a_dataloader_worker_starts_does_not_kill_it():
    """A SIGTERM to the whole tree just as a rank starts its DataLoader workers (after torch's worker
    installs its handler, which dies of a SIGTERM its rank did not send, and before LoaderWorkerInit ignores
    it) killed the worker: the run failed, or hung at exit waiting for the other worker. The workers start
    with the signals held now, and the one that came is dropped when they ignore it."""
    done = subprocess.run(
        [sys.executable, "-c", _WORKER_SIGNALLED_AT_START],
        capture_output=True,
        text=True,
        timeout=120,
        env=env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [32, 32, 32]


def _as_pid_1() -> tuple[str, ...]:
    """The prefix that runs a command as pid 1 of a pid namespace of its own, as a container's first process
    runs (skips where that is not allowed: it takes root)."""
    prefix = ("unshare", "--fork", "--pid", "--mount-proc")
    if shutil.which("unshare") is None or subprocess.run([*prefix, "true"], capture_output=True).returncode:
        pytest.skip("needs unshare and the right to make a pid namespace")
    return prefix


@pytest.mark.parametrize(
    "extra", [("--nproc", "2"), ("--nproc", "1", "--workers", "2")], ids=["nproc-2", "workers"]
)
def test_a_launcher_that_is_a_containers_first_process_trains(tmp_path, extra):
    """`docker run IMAGE tandem train` (no --init) makes the launcher pid 1. Its torchrun, and a single
    process's DataLoader workers, took a parent of pid 1 for a dead parent and exited at once ("the
    training processes failed, torchrun exit status 1")."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "tandem", "train", *ON_CPU, *extra, *TINY, "--out", str(out)]
    done = subprocess.run(
        [*_as_pid_1(), *command, "--master-port", free_port()],
        capture_output=True, text=True, timeout=300, env=env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert (out / "metrics.json").exists()


def test_one_sigterm_delivered_twice_to_the_launcher_is_one_request(monkeypatch):
    """`timeout`, systemd and Slurm send SIGTERM to the process group and forward it to the launcher as
    well: the launcher gets it twice at once, one request passed on once (it once ended everything,
    without the stop's checkpoint); a SIGTERM later, or Ctrl-C twice, ends the run at once."""
    from tandem.cli import train as cli_train

    class Proc:
        pid, kills = 4242, 0

        def kill(self):
            self.kills += 1

    sent = []
    monkeypatch.setattr(cli_train, "_children", lambda pid: [pid + 1])
    monkeypatch.setattr(cli_train.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    clock = [100.0]
    monkeypatch.setattr(cli_train.time, "monotonic", lambda: clock[0])
    handler = cli_train._LaunchSignals(Proc())
    handler(signal.SIGTERM, None)
    clock[0] += 0.2
    handler(signal.SIGTERM, None)  # the forwarded copy
    assert sent == [(4243, signal.SIGTERM)] and handler.proc.kills == 0
    clock[0] += 5.0
    handler(signal.SIGTERM, None)
    assert handler.proc.kills == 1 and handler.received == [signal.SIGTERM, signal.SIGTERM]
    person = cli_train._LaunchSignals(Proc())
    person(signal.SIGINT, None)
    person(signal.SIGINT, None)
    assert person.proc.kills == 1


def test_a_signal_before_the_ranks_exist_reaches_each_as_it_starts(monkeypatch):
    """Ctrl-C in the first seconds, before torchrun had started a rank: the launcher said "stopping after
    the current step", passed the signal to no one, and the run trained to its end with exit status 0.
    Now each rank that appears gets it (a second Ctrl-C still kills everything)."""
    from tandem.cli import train as cli_train

    class Proc:
        pid, kills = 4242, 0

        def kill(self):
            self.kills += 1

    ranks: list[int] = []
    sent = []
    monkeypatch.setattr(cli_train, "_children", lambda pid: list(ranks))
    monkeypatch.setattr(cli_train.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    handler = cli_train._LaunchSignals(Proc())
    handler(signal.SIGINT, None)
    handler.pass_on_pending()
    assert sent == [] and handler.pending == signal.SIGINT
    ranks.append(5000)
    handler.pass_on_pending()
    ranks.append(5001)
    handler.pass_on_pending()
    handler.pass_on_pending()
    assert sent == [(5000, signal.SIGINT), (5001, signal.SIGINT)]
    # a rank died as the request came: torchrun starts both again, which hear it too (they trained to the
    # end of the run, exit status 0)
    ranks[:] = [6000, 6001]
    handler.pass_on_pending()
    handler.pass_on_pending()
    assert sent[2:] == [(6000, signal.SIGINT), (6001, signal.SIGINT)]
    assert handler.proc.kills == 0


@pytest.mark.parametrize("signals", [1, 2])
def test_a_signal_while_torchrun_is_being_started_is_taken_once_it_has(monkeypatch, signals):
    """The handler was installed once torchrun had started: a Ctrl-C while it was being started was a
    KeyboardInterrupt traceback or, in the fork's hooks, lost (the run trained to its end, exit status 0).
    Now it is installed first: one signal goes on to the ranks as they appear, two kill torchrun."""
    from tandem.cli import train as cli_train

    class Proc:
        pid, kills = 4242, 0

        def kill(self):
            self.kills += 1

    sent = []
    monkeypatch.setattr(cli_train, "_children", lambda pid: [5000, 5001])
    monkeypatch.setattr(cli_train.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    handler = cli_train._LaunchSignals(None)
    for _ in range(signals):
        handler(signal.SIGINT, None)  # before torchrun exists: no error
    proc = Proc()
    handler.started(proc)
    if signals == 1:
        assert sent == [(5000, signal.SIGINT), (5001, signal.SIGINT)] and proc.kills == 0
    else:
        assert proc.kills == 1


@pytest.mark.parametrize("verdict, expected", [("2", 2), ("130", 130), (None, 0)])
def test_the_ranks_ending_wins_over_a_signal_that_came_with_it(monkeypatch, tmp_path, verdict, expected):
    """A SIGTERM reached the launcher while the ranks ended for a recording they could not read (their
    verdict 2, which every --resume would meet again): the launcher said "stopped; to continue: ...
    --resume" and exited 130. Their verdict wins now, as does a run that finished (0); a stop is 130."""
    import argparse
    import threading

    from tandem.asr.interrupt import EXIT_FILE_ENV
    from tandem.cli import train as cli_train

    started = tmp_path / "started"
    write = f"open(os.environ[{EXIT_FILE_ENV!r}], 'w').write('{verdict}')" if verdict else "0"
    torchrun = f"import os, time; open({str(started)!r}, 'w').close(); time.sleep(2); {write}"
    monkeypatch.setattr(cli_train, "_torchrun_command", lambda args: [sys.executable, "-c", torchrun])
    parser = argparse.ArgumentParser()
    cli_train.add_arguments(parser)
    args = cli_train._with_defaults(parser.parse_args(["--nproc", "2", "--out", str(tmp_path / "run")]))

    def signal_the_launcher() -> None:
        deadline = time.monotonic() + 30
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)  # to _launch's handler, installed before torchrun started

    thread = threading.Thread(target=signal_the_launcher)
    thread.start()
    try:
        assert cli_train._launch(args) == expected
    finally:
        thread.join(30)


def test_a_second_sigint_ends_the_run_at_once_and_keeps_the_checkpoints(tmp_path):
    out = tmp_path / "run"
    proc = start("--nproc", "2", *TINY, "--out", str(out), "--master-port", free_port(), log=tmp_path / "log")
    try:
        wait_for(out / "checkpoint-00000005.pt", proc)
        os.kill(proc.pid, signal.SIGINT)
        os.kill(proc.pid, signal.SIGINT)
        started = time.monotonic()
        code = proc.wait(30)
        assert time.monotonic() - started < 10
    finally:
        finish(proc, out)
    assert code == 130
    deadline = time.monotonic() + 30  # the workers die with torchrun
    while processes_mentioning(str(out)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not processes_mentioning(str(out))
    state, path, skipped = CheckpointStore(out).latest()
    assert state is not None and not skipped and state["step"] >= 5


def test_a_damaged_checkpoint_falls_back_to_the_previous_one(reference, tmp_path):
    out = tmp_path / "run"
    args = ("--nproc", "2", *TINY, "--out", str(out), "--master-port", free_port())
    proc = start(*args, log=tmp_path / "log")
    try:
        wait_for(out / "checkpoint-00000010.pt", proc)
        os.kill(proc.pid, signal.SIGINT)
    finally:
        assert finish(proc, out) == 130
    newest = CheckpointStore(out).numbered()[-1]
    with open(newest, "r+b") as f:  # checkpoint.pt is the same file (a hard link): both are damaged
        f.truncate(newest.stat().st_size // 2)
    # and what a process killed outright in the middle of the next save left (a second Ctrl-C, SIGKILL)
    partial = [out / ".checkpoint-00000015.pt.tmp-99999", out / ".checkpoint.pt.link-99999"]
    for p in partial:
        shutil.copyfile(newest, p)
    rest = tandem(*args, "--resume")
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert (
        "skipping an unreadable checkpoint" in rest.stdout and "continuing from the previous" in rest.stdout
    )
    assert "Traceback" not in rest.stdout + rest.stderr
    _assert_same_run(out, reference)
    assert not any(p.exists() for p in partial)  # removed by the run that holds the folder


def test_a_checkpoint_of_another_version_is_not_skipped_for_an_older_one(reference, tmp_path):
    """--resume skipped the newest checkpoints as unreadable when another tandem (a newer one) wrote them,
    continued from an older one of this version, and its saves replaced and rotated them away."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    newest = CheckpointStore(out).numbered()[-1]
    for path in (newest, out / "checkpoint.pt"):
        state = torch.load(path, weights_only=True)
        torch.save({**state, "version": state["version"] + 1}, path)
    before = {p.name: p.read_bytes() for p in out.glob("checkpoint*.pt")}
    args = ("--nproc", "2", *TINY, "--epochs", "2", "--out", str(out), "--master-port", free_port())
    done = tandem(*args, "--resume", timeout=120)
    expected = f"--resume: {out / 'checkpoint.pt'}: checkpoint version 2, this tandem reads version 1 ("
    assert done.returncode == 2 and expected in done.stderr, done.stdout[-2000:] + done.stderr[-2000:]
    assert {p.name: p.read_bytes() for p in out.glob("checkpoint*.pt")} == before


def test_no_readable_checkpoint_is_a_clear_refusal(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(b"PK\x03\x04 not really a zip")
    done = tandem("--nproc", "2", *TINY, "--out", str(out), "--resume", timeout=120)
    assert done.returncode == 2
    assert "--resume: no readable checkpoint in" in done.stderr and "Traceback" not in done.stderr
    assert [p.name for p in out.iterdir()] == ["checkpoint.pt"]


def test_a_fresh_run_sets_an_earlier_runs_checkpoints_aside(reference, tmp_path):
    """A run started in a folder that holds a run's checkpoints, without --resume (by mistake, or a new
    run): the earlier checkpoints go to previous/, said on stdout, not deleted."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    before = load_checkpoint(reference / "checkpoint.pt")["step"]
    done = tandem("--nproc", "1", *TINY, "--epochs", "1", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{out} held an earlier run's checkpoints and outputs; moved to {out / 'previous'}" in done.stdout
    assert load_checkpoint(out / "previous" / "checkpoint.pt")["step"] == before
    assert load_checkpoint(out / "checkpoint.pt")["world_size"] == 1  # the new run's
    # the earlier run's metrics went with its checkpoints: what is in the folder is the new run's
    assert json.loads((out / "previous" / "metrics.json").read_text())["world_size"] == 2
    assert json.loads((out / "metrics.json").read_text())["world_size"] == 1


def test_a_second_run_into_the_folder_of_a_running_one_is_refused_and_touches_nothing(tmp_path):
    """Two runs in one --out (a command run twice, a second terminal): the second would set the first's
    checkpoints aside under it, or they would overwrite each other's. It is refused while the first runs,
    with the first's files as they were, and the first goes on to its end."""
    out = tmp_path / "run"
    proc = start("--nproc", "2", *TINY, "--out", str(out), "--master-port", free_port(), log=tmp_path / "log")
    try:
        wait_for(out / "checkpoint-00000005.pt", proc)
        first = processes_mentioning(str(out))  # launcher, torchrun, workers
        for pid in first:  # the first run's files hold still while the second tries
            os.kill(pid, signal.SIGSTOP)
        try:
            before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
            for extra in ((), ("--resume",)):
                second = tandem("--nproc", "1", *TINY, "--out", str(out), *extra, timeout=60)
                assert second.returncode == 2, second.stderr[-3000:]
                assert f"--out {out}: another tandem train is writing to this folder" in second.stderr
                assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
                assert not (out / "previous").exists()
        finally:
            for pid in first:
                os.kill(pid, signal.SIGCONT)
        code = proc.wait(120)
    finally:
        finish(proc, out)
    assert code == 0, (tmp_path / "log").read_text()[-3000:]
    assert (out / "metrics.json").exists()
    # the first run has ended: the folder is free again
    again = tandem("--nproc", "1", *TINY, "--out", str(out), "--resume", timeout=120)
    assert "another tandem train" not in again.stderr


@pytest.mark.parametrize(
    "rank, launched_by_tandem, refused",
    [("0", False, True), ("1", False, False), ("0", True, False)],
    ids=["rank-0-by-hand", "rank-1-by-hand", "under-tandems-launcher"],
)
def test_under_a_torchrun_started_by_hand_rank_0_holds_the_folder(
    tmp_path, monkeypatch, capsys, rank, launched_by_tandem, refused
):
    """``torchrun -m tandem train`` has no tandem launcher to hold --out: rank 0 holds it. Under tandem's
    own launcher, which holds it already, and on the other ranks, the workers take no lock."""
    import fcntl

    from tandem.cli import main as cli_main
    from tandem.cli import train as train_cli

    worked = []
    monkeypatch.setattr(train_cli, "_work", lambda args: worked.append(args.out) or 0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    if launched_by_tandem:
        monkeypatch.setenv(train_cli._OUT_HELD_ENV, "1")
    else:
        monkeypatch.delenv(train_cli._OUT_HELD_ENV, raising=False)
    fd = os.open(tmp_path, os.O_RDONLY)  # another run's hold on the folder
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        code = cli_main.main(["train", "--out", str(tmp_path)])
    finally:
        os.close(fd)
    assert (code, worked) == ((2, []) if refused else (0, [tmp_path]))
    assert ("another tandem train is writing to this folder" in capsys.readouterr().err) == refused


def test_a_loss_that_becomes_nan_stops_at_once_and_no_nan_is_saved(tmp_path):
    """lr 1e6: the loss becomes NaN within a few steps. The run stops at that step (not at the epoch's
    end, saving NaN weights over the good ones on the way), with one error and no restarts."""
    out = tmp_path / "run"
    done = tandem("--nproc", "1", *TINY, "--lr", "1e6", "--checkpoint-every", "1", "--out", str(out))
    assert done.returncode == 1, done.stderr[-3000:]
    assert "tandem train: error:" in done.stderr and "Traceback" not in done.stderr
    assert "the loss became nan at step" in done.stderr or "weights are no longer finite" in done.stderr
    for path in out.glob("checkpoint*.pt"):
        weights = load_checkpoint(path)["model"]
        assert all(bool(torch.isfinite(w).all()) for w in weights.values() if w.is_floating_point()), path


def test_checkpoints_rotate(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    state = {"model_config": {}, "feature_config": {}, "alphabet": "ab", "model": {}, "step": 0}
    for step in (5, 10, 15):
        store.save({**state, "step": step}, step)
    assert [p.name for p in store.numbered()] == ["checkpoint-00000010.pt", "checkpoint-00000015.pt"]
    assert load_checkpoint(store.path)["step"] == 15
    assert os.path.samefile(store.path, tmp_path / "checkpoint-00000015.pt")
    with pytest.raises(ValueError, match="keep >= 1"):
        CheckpointStore(tmp_path, keep=0)


def test_runs_set_aside_are_never_deleted(tmp_path):
    """Each fresh run into a folder moves the one before it into a folder of its own: previous/, then
    previous-2/...; a file of the user's in previous/ stays too."""
    store = CheckpointStore(tmp_path, keep=2)
    state = {"model_config": {}, "feature_config": {}, "alphabet": "ab", "model": {}, "step": 0}
    for run in (1, 2, 3):
        store.save({**state, "step": run}, run)
        (tmp_path / "metrics.json").write_text(str(run))
        aside = store.set_aside()
        assert aside == tmp_path / ("previous" if run == 1 else f"previous-{run}")
        assert not list(tmp_path.glob("checkpoint*.pt")) and not (tmp_path / "metrics.json").exists()
        if run == 1:
            (aside / "notes.txt").write_text("mine")
    for name, run in (("previous", 1), ("previous-2", 2), ("previous-3", 3)):
        assert load_checkpoint(tmp_path / name / "checkpoint.pt")["step"] == run
        assert (tmp_path / name / "metrics.json").read_text() == str(run)
    assert (tmp_path / "previous" / "notes.txt").read_text() == "mine"


def test_resume_where_only_runs_set_aside_are_says_where_they_are(tmp_path):
    from tandem.cli.train import _check_out

    (tmp_path / "previous-2").mkdir()
    (tmp_path / "previous-2" / "checkpoint.pt").write_bytes(b"")
    message = _check_out(tmp_path, resume=True)
    assert message is not None and "found none (earlier runs were set aside in previous-2/ there" in message
    # a file named like a checkpoint but none the run writes: the same (it said "no readable checkpoint
    # in ... ()" after a launch's check had read nothing)
    (tmp_path / "checkpoint_backup.pt").write_bytes(b"")
    assert _check_out(tmp_path, resume=True) == message


def test_a_checkpoint_that_cannot_be_written_keeps_the_previous_one(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    state = {"model_config": {}, "feature_config": {}, "alphabet": "ab", "model": {}, "step": 5}
    store.save(state, 5)
    (tmp_path / "checkpoint-00000010.pt").mkdir()  # where step 10's goes: the rename onto it fails
    with pytest.raises(CheckpointWriteError, match=r"checkpoint-00000010\.pt: not written \(.*\); .* free"):
        store.save({**state, "step": 10}, 10)
    assert load_checkpoint(store.path)["step"] == 5
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["checkpoint-00000005.pt", "checkpoint-00000010.pt", "checkpoint.pt"]  # no temporaries


def test_a_full_disk_stops_the_run_with_a_clear_error_and_no_restarts(tmp_path):
    """A limit on file sizes fails the first checkpoint's write (EFBIG, as a full disk's ENOSPC would): the
    ranks stop together, the error names the file, and torchrun does not restart them into it again."""
    out = tmp_path / "run"
    limit = 64 * 1024  # TINY's checkpoint is ~0.4 MB; the TensorBoard events stay below

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    command = ["--nproc", "2", *TINY, "--out", str(out), "--master-port", free_port()]
    done = subprocess.run(
        [sys.executable, "-m", "tandem", "train", *ON_CPU, *command],
        capture_output=True, text=True, timeout=300, env=env(), preexec_fn=small_files,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    assert "tandem train: error: the checkpoint after step 5: " in done.stderr, done.stderr[-3000:]
    assert "checkpoint-00000005.pt: not written" in done.stderr and "No checkpoint of this run" in done.stderr
    # nothing to resume from: the advice is to run the command again, not with --resume (which is refused)
    assert "make room, then run the same command" in done.stderr and "--resume" not in done.stderr
    assert "Traceback" not in done.stderr and "torchrun exit status" not in done.stderr
    assert done.stdout.count("tandem train: speech recognition") == 1  # one launch: no restarts
    assert not list(out.glob("*.pt")) and not list(out.glob(".*tmp*"))


def test_metrics_that_cannot_be_written_are_a_clear_error_after_the_last_checkpoint(tmp_path):
    out = tmp_path / "run"
    (out / "metrics.json").mkdir(parents=True)  # the rename onto it fails, as a full disk's write would
    done = tandem("--nproc", "2", *TINY, "--out", str(out), "--master-port", free_port())
    assert done.returncode == 1, done.stderr[-3000:]
    assert f"tandem train: error: {out / 'metrics.json'}: not written (" in done.stderr, done.stderr[-3000:]
    assert "the run is done and wrote checkpoint.pt to" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout.count("tandem train: speech recognition") == 1
    assert load_checkpoint(out / "checkpoint.pt")["epoch"] == 1


def _two_nodes(tmp_path: Path, *extra: str) -> tuple[list, Path]:
    out, port = tmp_path / "run", free_port()
    procs = [
        start(
            "--nnodes",
            "2",
            "--node-rank",
            str(rank),
            "--nproc",
            "1",
            "--master-port",
            port,
            *TINY,
            "--out",
            str(out),
            *extra,
            log=tmp_path / f"node{rank}.log",
        )  # fmt: skip
        for rank in (0, 1)
    ]
    return procs, out


def test_two_nodes_compute_what_one_node_with_two_processes_computes(reference, tmp_path):
    procs, out = _two_nodes(tmp_path)
    # both nodes end by themselves before anything is cleaned up: finish() kills every process of the
    # run, and node 1's launcher may still be on its way out when node 0's has returned (seen in CI, -9)
    try:
        codes = [p.wait(180) for p in procs]
    finally:
        for p in procs:
            finish(p, out)
    logs = [(tmp_path / f"node{r}.log").read_text() for r in (0, 1)]
    assert codes == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    _assert_same_run(out, reference)


def test_a_node_that_dies_makes_the_other_exit_with_a_clear_error(tmp_path):
    procs, out = _two_nodes(tmp_path, "--rdzv-timeout", "20", "--timeout", "20", "--max-restarts", "1")
    try:
        wait_for(out / "checkpoint-00000005.pt", procs[0])
        os.killpg(procs[1].pid, signal.SIGKILL)  # node 1's launcher and torchrun; its worker dies with them
        started = time.monotonic()
        code = procs[0].wait(150)
        waited = time.monotonic() - started
    finally:
        for p in procs:
            finish(p, out)
    log = (tmp_path / "node0.log").read_text()
    assert code != 0 and waited < 150
    assert "tandem train: error: the training processes failed" in log and "--rdzv-timeout" in log


def test_one_signal_delivered_twice_is_one_stop_request(monkeypatch):
    """A signal sent to the whole process tree reaches a worker directly and again through torchrun: that
    is one request (the run stops after its step, with its checkpoint); a second one later, or another
    signal, ends the process at once."""
    from tandem.asr import interrupt

    exits = []
    monkeypatch.setattr(interrupt.os, "_exit", exits.append)
    clock = [100.0]
    monkeypatch.setattr(interrupt.time, "monotonic", lambda: clock[0])
    monkeypatch.setenv("WORLD_SIZE", "2")  # a torchrun worker
    stop = interrupt.StopRequests()
    stop._handle(signal.SIGTERM, None)
    clock[0] += 0.2
    stop._handle(signal.SIGTERM, None)  # the forwarded copy
    assert stop.signal == signal.SIGTERM and exits == []
    clock[0] += 5.0
    stop._handle(signal.SIGTERM, None)
    assert exits == [128 + signal.SIGTERM]
    other = interrupt.StopRequests()
    other._handle(signal.SIGTERM, None)
    other._handle(signal.SIGINT, None)
    assert exits[-1] == 128 + signal.SIGINT
    # a single process (--nproc 1, no torchrun) gets each signal once: a second Ctrl-C within the second
    # is a second request, and ends it at once (it was taken for the first, delivered twice)
    monkeypatch.delenv("WORLD_SIZE")
    alone = interrupt.StopRequests()
    alone._handle(signal.SIGINT, None)
    clock[0] += 0.3
    alone._handle(signal.SIGINT, None)
    assert exits[-1] == 128 + signal.SIGINT and len(exits) == 3


def test_ctrl_c_with_both_outputs_on_a_closed_pipe_stops_the_run(tmp_path):
    """``tandem train 2>&1 | head -1``, then Ctrl-C: the launcher's signal handler wrote its note to the
    closed pipe first and died of BrokenPipeError, so the ranks never heard of the stop and trained on. The
    launcher's output forgives the pipe too: the ranks stop after a checkpoint, status 130."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem", "train", *ON_CPU, "--nproc", "2", *TINY, "--out", str(out)]
        + ["--master-port", free_port()],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env(), start_new_session=True,
    )  # fmt: skip
    proc.stdout.close()  # the reader is gone before the first line
    try:
        wait_for(out / "checkpoint-00000005.pt", proc)
        os.kill(proc.pid, signal.SIGINT)
    finally:
        code = finish(proc, out)
    assert code == 130
    assert 5 <= load_checkpoint(out / "checkpoint.pt")["step"] < 22 and not (out / "metrics.json").exists()
