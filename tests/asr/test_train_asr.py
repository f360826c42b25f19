"""``tandem train`` (speech recognition, the default task) end to end: real processes through torchrun,
Gloo on 127.0.0.1, bounded in time, on a small model (stopping and resuming: test_fault_tolerance.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from _cli import free_port, tandem, tandem_in_process

import tandem.asr.training as training
from tandem.asr.checkpoint import load_checkpoint
from tandem.asr.corpus import load_spoken_digits
from tandem.asr.distributed import Group
from tandem.asr.generator import ConnectedDigits, split_recordings
from tandem.asr.model import ModelConfig
from tandem.asr.training import DataSets, Run, TrainConfig, epoch_batches

# A smaller model that still learns the digits in a few epochs (about 5 s an epoch on two cores; 6 epochs
# reached a test WER of 19.5%).
SMALL = ("--hidden", "96", "--layers", "2", "--warmup-steps", "20")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("asr") / "run"
    done = tandem("--nproc", "2", "--epochs", "6", "--out", str(out), *SMALL, "--master-port", free_port())
    assert done.returncode == 0, done.stderr[-3000:]
    (out / "stdout.txt").write_text(done.stdout)
    return out


def test_two_processes_learn_the_digits(trained):
    metrics = json.loads((trained / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["epochs"] == 6 and len(metrics["history"]) == 6
    # chance is a WER of 100% (nothing recognised); a few epochs of this small model get far below it
    assert metrics["test_wer"] < 0.4 and metrics["test_cer"] < 0.15, metrics["history"]
    assert metrics["history"][-1]["test_wer"] < metrics["history"][0]["test_wer"]
    assert metrics["config"]["model"]["hidden"] == 96 and metrics["train_seconds"] > 0
    assert 0 < metrics["peak_rss_mib"] < 2048
    assert (trained / "training_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    stdout = (trained / "stdout.txt").read_text()
    assert "wrote checkpoint.pt, metrics.json, training_curve.png" in stdout
    assert not [p for p in trained.iterdir() if p.name.startswith(".")], "temporary files left behind"


def test_tensorboard_events(trained):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = accumulator.EventAccumulator(str(trained), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    wer = [e.value for e in events.Scalars("test/wer")]
    metrics = json.loads((trained / "metrics.json").read_text())
    assert wer == pytest.approx([h["test_wer"] for h in metrics["history"]])
    steps = [e.step for e in events.Scalars("train/loss")]
    assert steps == list(range(1, metrics["steps"] + 1))
    assert len(events.Scalars("train/learning_rate")) == len(steps)
    assert "test/transcripts/text_summary" in events.Tags()["tensors"]
    assert "TensorBoard events" in (trained / "stdout.txt").read_text()


def test_checkpoint_describes_itself(trained):
    state = load_checkpoint(trained / "checkpoint.pt")
    assert state["model_config"]["hidden"] == 96 and state["model_config"]["cell"] == "gru"
    assert (
        state["alphabet"] == " 'abcdefghijklmnopqrstuvwxyz" and state["feature_config"]["sample_rate"] == 8000
    )
    assert state["epoch"] == 6 and state["world_size"] == 2 and "weight_hh_l0" in "".join(state["model"])


def test_resuming_a_finished_run_says_it_is_finished(trained, tmp_path):
    """``--resume`` of a run that trained all its epochs said "resuming at step 132 (epoch 7, batch 0)" for a
    6-epoch run; it says that every epoch is done, trains nothing and keeps the weights."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(trained, out)
    before = load_checkpoint(out / "checkpoint.pt")
    args = ("--nproc", "2", "--epochs", "6", "--out", str(out), *SMALL, "--master-port", free_port())
    done = tandem(*args, "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "its checkpoint has trained all 6 epoch(s)" in done.stdout and "resuming at" not in done.stdout
    last = done.stdout.splitlines()[-1]  # it names only what this launch wrote (it said checkpoint.pt)
    assert last.startswith("done:") and "wrote metrics.json, training_curve.png" in last, last
    after = load_checkpoint(out / "checkpoint.pt")
    assert after["step"] == before["step"]
    assert all(torch.equal(after["model"][k], v) for k, v in before["model"].items())


def test_without_matplotlib_and_tensorboard_the_closing_line_names_only_what_was_written(tmp_path):
    blocked = tmp_path / "blocked"
    for package in ("matplotlib", "tensorboard"):
        (blocked / package).mkdir(parents=True)
        (blocked / package / "__init__.py").write_text(
            f"raise ImportError('{package} is blocked for this test')\n"
        )
    out = tmp_path / "run"
    done = tandem(
        "--nproc", "1", "--epochs", "1", "--hidden", "16", "--layers", "1", "--out", str(out),
        # the epoch's end writes the one numbered checkpoint, however slow the machine (by default a minute
        # of training writes one too: on a GPU machine's 14 test processes one more came at step 20)
        "--checkpoint-every", "1000",
        pythonpath=(str(blocked),),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "matplotlib is not installed" in done.stdout
    assert done.stdout.splitlines()[-1].endswith(f"wrote checkpoint.pt, metrics.json to {out}")
    assert sorted(p.name for p in out.iterdir()) == [
        "checkpoint-00000022.pt",
        "checkpoint.pt",
        "metrics.json",
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        (("--test-speaker", "nobody"), "--test-speaker: expected one of george, jackson"),
        (("--data", "x.npz"), "--data: only for --task classify"),
        (("--warmup-steps", "-1"), "--warmup-steps: expected a number >= 0, got -1"),
        (("--task", "classify", "--test-speaker", "theo"), "--test-speaker: only for --task asr"),
        (("--task", "classify", "--normalize", "band"), "--normalize: only for --task asr"),
        (("--seed", "-1"), "--seed: expected a seed from 0 to 4294967295, got -1"),
        # a typo that ended in an allocation traceback after the launch
        (
            ("--hidden", "100000000"),
            "--hidden 100000000, --layers 3, --conv-channels 16: a model of 4.2e+17 ",
        ),
        (("--hidden", str(10**12)), "a model too large to count (its sizes overflow)"),
        (("--hidden", str(2**62)), "a model too large to count (its sizes overflow)"),
        # torchrun retried for a minute, then a traceback
        (
            ("--nnodes", "2", "--node-rank", "1", "--master-addr", "no.such.host.invalid"),
            "--master-addr: expected a host name or address of node 0, got 'no.such.host.invalid' (",
        ),
        # a seed numpy or torch cannot take failed after an earlier run had been set aside
        (("--seed", str(2**64)), "--seed: expected a seed from 0 to 4294967295, got 18446744073709551616"),
        (("--nproc", "2", "--batch-size", "1"), "--batch-size: expected at least one utterance per process"),
        # tracebacks from deep inside (timedelta, torch.set_num_threads, torchrun's int())
        (("--timeout", "1e300"), "--timeout: expected seconds from 1 to 1e+07, got '1e300'"),
        (("--timeout", "1e-9"), "--timeout: expected seconds from 1 to 1e+07, got '1e-9'"),
        (("--threads", "99999999999"), "--threads: expected a thread count from 1 to 4096, got 99999999999"),
        (("--rdzv-timeout", "0.5"), "--rdzv-timeout: expected whole seconds from 1 to 10000000, got '0.5'"),
        # no upper bound: the launcher counted a model of 10^24 layers for ever, forked loader workers
        # without end, planned every epoch's batches before the first step, overflowed torchrun's timedelta
        (("--layers", str(10**24)), f"--layers: expected a number of layers from 1 to 1000, got {10**24}"),
        (
            ("--workers", "100000"),
            "--workers: expected a number of worker processes from 0 to 256, got 100000",
        ),
        (("--epochs", str(10**9)), "--epochs: expected a number of epochs from 1 to 10000, got 1000000000"),
        (("--rdzv-timeout", str(10**24)), "--rdzv-timeout: expected whole seconds from 1 to 10000000, got 1"),
        # the classifier's size was not checked: an allocation traceback after the launch
        (
            ("--task", "classify", "--hidden", "100000000"),
            "--hidden 100000000, --layers 2: the classifier of ",
        ),
        (("--master-port", "0"), "--master-port: expected a port from 1 to 65535, got 0"),
        # the blank's sign was dropped without a word; upper case can never occur in a transcript
        (("--alphabet", "_"), "--alphabet: '_' stands for the CTC blank and cannot be a character"),
        (("--alphabet", "Éé"), "--alphabet: transcripts are lower-cased, so 'É' can never occur; give 'é'"),
        # nor other whitespace than the space: a run of it becomes one space (a class never seen)
        (("--alphabet", "é\t\u00a0"), "--alphabet: whitespace in transcripts becomes one space"),
    ],
)
def test_bad_options_are_refused_before_anything_is_written(tmp_path, capsys, args, message):
    """In this process (a refusal ends before anything starts; test_a_bad_option_is_refused_by_the_command
    runs one through the command itself)."""
    out = tmp_path / "out"
    code = tandem_in_process(*args, "--out", str(out))
    assert code == 2 and message in capsys.readouterr().err
    assert not out.exists()


def test_a_bad_option_is_refused_by_the_command(tmp_path):
    out = tmp_path / "out"
    done = tandem("--seed", "-1", "--out", str(out), timeout=60)
    message = "--seed: expected a seed from 0 to 4294967295, got -1"
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
    assert not out.exists()


def test_an_empty_out_is_refused_not_taken_for_the_current_folder(tmp_path):
    """``Path("")`` is ".": ``--out ""`` trained into the current folder (setting aside a run there)."""
    done = tandem("--out", "", "--epochs", "1", timeout=60, cwd=tmp_path)
    assert done.returncode == 2 and "--out: expected a path, got ''" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_worker_of_a_torchrun_started_by_hand_checks_the_options_too(tmp_path):
    """Under ``torchrun ... -m tandem train`` (WORLD_SIZE set, no tandem launcher) nothing was checked:
    a negative warm-up trained, an unknown speaker or a negative --workers ended in a traceback."""
    out = tmp_path / "out"
    for args, message in (
        (("--warmup-steps", "-500"), "--warmup-steps: expected a number >= 0, got -500"),
        (("--test-speaker", "nobody"), "--test-speaker: expected one of george"),
        (("--workers", "-2"), "--workers: expected a number of worker processes from 0 to 256, got -2"),
        (("--task", "classify", "--workers", "1"), "--workers: only for --task asr"),
    ):
        torchrun = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}
        done = tandem(*args, "--out", str(out), timeout=60, extra_env=torchrun)
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, args
        assert not out.exists()


@pytest.mark.parametrize(
    "environment, message",
    [
        ({"WORLD_SIZE": "abc"}, "environment variable WORLD_SIZE: expected a positive integer"),
        ({"WORLD_SIZE": "2"}, "environment variable RANK: not set, where WORLD_SIZE is (2)"),
        ({"WORLD_SIZE": "1", "RANK": "0", "LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE: expected an integer"),
    ],
    ids=["world-abc", "world-without-rank", "local-world-0"],
)
def test_torchruns_variables_that_do_not_fit_are_one_error(tmp_path, environment, message):
    """A WORLD_SIZE left over from a job script, or mistyped: tracebacks deep in the process group's start
    (a ValueError, env://'s missing RANK, a ZeroDivisionError), some after --out was made."""
    out = tmp_path / "out"
    done = tandem("--task", "classify", "--epochs", "1", "--out", str(out), timeout=60, extra_env=environment)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
    assert not out.exists()


def test_a_single_process_ignores_torchruns_local_variables_left_in_its_environment(tmp_path):
    """LOCAL_WORLD_SIZE without WORLD_SIZE is no torchrun's: it was read (a ValueError for 'abc')."""
    out = tmp_path / "out"
    environment = {"LOCAL_WORLD_SIZE": "abc", "LOCAL_RANK": "x"}
    done = tandem("--task", "classify", "--nproc", "1", "--epochs", "1", *("--hidden", "8", "--layers", "1"),
                  "--out", str(out), timeout=120, extra_env=environment)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_device_cuda_without_cuda_is_refused_before_launching(tmp_path):
    out = tmp_path / "out"
    done = tandem("--device", "cuda", "--out", str(out), timeout=60)
    assert done.returncode == 2 and "--device cuda: CUDA is not available" in done.stderr
    assert "Traceback" not in done.stderr and not out.exists()


@pytest.mark.parametrize(
    "device, gpus, nproc, expected",
    [
        ("auto", 0, None, 2),  # no GPU: two processes on the CPU
        ("auto", 1, None, 1),  # one process per GPU
        ("cuda", 4, None, 4),
        ("cpu", 4, None, 2),
        ("auto", 4, 3, 3),
        ("auto", 1, 2, "--nproc: expected at most 1 on CUDA (one process per GPU; this machine has 1)"),
        ("cpu", 1, 2, 2),
    ],
)
def test_nproc_defaults_to_one_process_per_gpu(monkeypatch, device, gpus, nproc, expected):
    """On CUDA every process takes the GPU of its local rank: the default is one per GPU, and more
    processes than GPUs is an error before anything launches (two ranks would meet on one GPU, or one
    would ask for a GPU that is not there)."""
    from tandem.cli import train as train_cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    args = argparse.Namespace(device=device, nproc=nproc)
    problem = train_cli._check_nproc(args)
    if isinstance(expected, str):
        assert problem is not None and problem.startswith(expected), problem
    else:
        assert problem is None and args.nproc == expected


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
    done = tandem("--resume", "--out", str(tmp_path / "empty"), timeout=60)
    assert done.returncode == 2 and "expected a checkpoint" in done.stderr
    assert not (tmp_path / "empty").exists()  # refused before anything was made


def test_resume_with_fewer_epochs_than_trained_is_refused():
    """More epochs continue a run; fewer than the checkpoint has trained would end it at once, with the
    checkpoint of one moment and metrics.json of another."""
    from tandem.asr.training import TrainConfig, resume_mismatch

    config = TrainConfig(epochs=6)
    state = {"train_config": config.to_dict(), "world_size": 2, "epoch": 2, "position": 5}
    assert resume_mismatch(config, 2, state) is None
    assert resume_mismatch(TrainConfig(epochs=9), 2, state) is None
    refused = resume_mismatch(TrainConfig(epochs=2), 2, state)
    assert (
        refused
        == "--epochs 2: the checkpoint has trained 2 epochs and 5 batches; resume with --epochs 3 or more"
    )
    finished = {**state, "epoch": 6, "position": 0}
    assert resume_mismatch(config, 2, finished) is None
    assert "trained 6 epochs; resume with --epochs 6 or more" in resume_mismatch(
        TrainConfig(epochs=5), 2, finished
    )


def test_the_closing_line_names_a_checkpoint_this_launch_wrote(tmp_path, monkeypatch):
    """A process that wrote no checkpoint itself: a finished run resumed wrote none; a group that torchrun
    restarted after its launch's last checkpoint wrote it before the restart (a checkpoint newer than the
    launch), unless that launch was a resume of a finished run (older)."""
    import os

    from tandem.asr.training import LAUNCHED_AT_ENV, _launch_wrote

    checkpoint = tmp_path / "checkpoint.pt"
    checkpoint.write_bytes(b"")
    os.utime(checkpoint, (1000.0, 1000.0))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert not _launch_wrote(checkpoint)  # no restart: the process would know
    monkeypatch.setenv("WORLD_SIZE", "2")  # (processes torchrun started)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv(LAUNCHED_AT_ENV, "999.5")
    assert _launch_wrote(checkpoint)
    monkeypatch.setenv(LAUNCHED_AT_ENV, "1000.5")
    assert not _launch_wrote(checkpoint)  # (it said checkpoint.pt after any restart)


def test_a_resume_names_the_options_whose_settings_differ():
    """It named settings by their keys ("model.hidden", "processes", "augment" where --test-speaker
    changed), which are no options of tandem train."""
    from tandem.asr.model import ModelConfig
    from tandem.asr.training import TrainConfig, resume_mismatch

    state = {"train_config": TrainConfig().to_dict(), "world_size": 2, "epoch": 1, "position": 0}
    other = TrainConfig(model=ModelConfig(hidden=64), test_speaker="theo", lr=0.1)
    message = resume_mismatch(other, 4, state)
    for part in (
        "--hidden: checkpoint 128, now 64",
        "--lr: checkpoint 0.03, now 0.1",
        "--test-speaker: checkpoint None, now 'theo'",
        "processes (--nproc x --nnodes): checkpoint 2, now 4",
    ):
        assert part in message, message


def test_a_run_from_before_normalize_resumes_with_its_options():
    """A checkpoint from before FeatureConfig.normalize (its features name none: they were "band") and the
    learning rate of then (0.05): ``--normalize band --lr 0.05`` resumes it, and without them the refusal
    names both options. It was refused whatever was given ("features.normalize: checkpoint None"), and
    tandem train had no option for the features."""
    import argparse

    from tandem.asr.features import NORMALIZATIONS
    from tandem.asr.training import resume_mismatch
    from tandem.cli import train as cli_train

    parser = argparse.ArgumentParser()
    cli_train.add_arguments(parser)

    def config(*args: str):
        return cli_train.asr_config(cli_train._with_defaults(parser.parse_args(args)))

    before = config("--lr", "0.05").to_dict()
    del before["features"]["normalize"]
    state = {"train_config": before, "world_size": 2, "epoch": 1, "position": 0}
    assert resume_mismatch(config("--normalize", "band", "--lr", "0.05"), 2, state) is None
    message = resume_mismatch(config(), 2, state)
    for part in ("--normalize: checkpoint 'band', now 'utterance'", "--lr: checkpoint 0.05, now 0.03"):
        assert part in message, message
    assert (
        config().features.normalize == "utterance"
        and config("--normalize", "band").features.normalize == "band"
    )
    normalize = next(a for a in cli_train._train_parser_actions() if a.dest == "normalize")
    assert tuple(normalize.choices) == NORMALIZATIONS


def test_the_error_curve_draws_epochs_at_zero_percent(tmp_path, monkeypatch):
    """The error panel's log axis dropped every epoch at 0 % WER/CER (a run on an easy test set drew
    nothing after it reached 0, and matplotlib warned when every epoch was 0): 0 is on the axis now."""
    plt = pytest.importorskip("matplotlib.pyplot")
    import warnings

    from tandem.asr.training import _plot

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    rates = [(0.5, 0.3), (0.02, 0.01), (0.0, 0.0)]
    history = [
        {"epoch": e, "train_loss": 1.0 / e, "test_wer": w, "test_cer": c} for e, (w, c) in enumerate(rates, 1)
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _plot(history, tmp_path / "curve.png") and _plot(history[2:], tmp_path / "zero.png")
    for figure in figures:
        low, high = figure.axes[1].get_ylim()
        assert low <= 0 < high
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("workers", [0, 1])
def test_a_long_run_draws_each_epochs_batches_when_it_reaches_it(monkeypatch, workers):
    """Every epoch's batches were drawn before the first step: 20-40 ms an epoch, minutes of silence before
    a run of 10,000 epochs began. The first steps now draw only their own epoch; the steps, across an
    epoch's end and from a resumed position, are those of epoch_batches."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    rec = load_spoken_digits()
    train_ids, test_ids = split_recordings(rec)
    data = DataSets(ConnectedDigits(rec, train_ids[:40]), ConnectedDigits(rec, test_ids[:8]))
    config = TrainConfig(
        model=ModelConfig(hidden=8, layers=1, conv_channels=2), augment=False, epochs=10_000, batch_size=8
    )
    run = Run(config, Group(torch.device("cpu"), 10), data)
    drawn = []
    counting = training.epoch_batches

    def epoch_batches_counted(train_set, cfg, epoch, world):
        drawn.append(epoch)
        return counting(train_set, cfg, epoch, world)

    monkeypatch.setattr(training, "epoch_batches", epoch_batches_counted)
    run.epoch, run.position = 3, 2  # as a resumed run
    per_epoch = run.batch_count(3)
    steps = run.batches(workers)
    got = [next(steps) for _ in range(per_epoch - 2 + 1)]  # the rest of epoch 3 and epoch 4's first
    assert set(drawn) <= {0, *range(3, 3 + 6)}  # (a DataLoader's workers are 4 steps ahead)
    expected = [epoch_batches(data.train, config, 3, 1)[p] for p in range(2, per_epoch)]
    expected.append(epoch_batches(data.train, config, 4, 1)[0])
    assert len(got) == len(expected)
    for (batch, size, problems), utterances in zip(got, expected):
        assert problems == [] and size == len(utterances)
        assert batch.transcripts == [u.transcript for u in sorted(utterances, key=lambda u: u.length)]
