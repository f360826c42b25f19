"""``tandem train`` (speech recognition, the default task) end to end: real processes through torchrun,
Gloo on 127.0.0.1, bounded in time, on a small model."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tandem.asr.checkpoint import load_checkpoint

SRC = Path(__file__).resolve().parents[2] / "src"
# A smaller model that still learns the digits in a few epochs (about 5 s an epoch on two cores; 6 epochs
# reached a test WER of 19.5%).
SMALL = ("--hidden", "96", "--layers", "2", "--warmup-steps", "20")


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _tandem(
    *args: str, timeout: float = 300, pythonpath: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    path = [*pythonpath, str(SRC), os.environ.get("PYTHONPATH")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
    return subprocess.run(
        [sys.executable, "-m", "tandem", "train", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("asr") / "run"
    done = _tandem("--nproc", "2", "--epochs", "6", "--out", str(out), *SMALL, "--master-port", _free_port())
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


def test_checkpoint_describes_itself(trained):
    state = load_checkpoint(trained / "checkpoint.pt")
    assert state["model_config"]["hidden"] == 96 and state["model_config"]["cell"] == "gru"
    assert (
        state["alphabet"] == " 'abcdefghijklmnopqrstuvwxyz" and state["feature_config"]["sample_rate"] == 8000
    )
    assert state["epoch"] == 6 and state["world_size"] == 2 and "weight_hh_l0" in "".join(state["model"])


def _processes_mentioning(text: str) -> list[int]:
    """Pids of the live processes whose command line contains ``text``."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _interrupted_after_first_epoch(args: tuple[str, ...], out: Path, timeout: float = 300) -> None:
    """Start ``tandem train`` and stop it with SIGTERM once the first epoch's checkpoint exists; return when
    the launcher and every worker (torchrun starts them in sessions of their own) are gone."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH")) if p)
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem", "train", *args, "--out", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + timeout
    try:
        while not (out / "checkpoint.pt").exists():
            assert proc.poll() is None, "tandem train ended before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within the timeout"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # torchrun passes it on to the workers
        proc.wait(30)
        end = time.monotonic() + 60
        while _processes_mentioning(str(out)) and time.monotonic() < end:
            time.sleep(0.1)
        for pid in _processes_mentioning(str(out)):
            os.kill(pid, signal.SIGKILL)


def test_resumed_run_ends_with_the_uninterrupted_weights(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = ("--nproc", "2", "--epochs", "2", *SMALL)
    first = _tandem(*common, "--out", str(straight), "--master-port", _free_port())
    assert first.returncode == 0, first.stderr[-3000:]
    _interrupted_after_first_epoch((*common, "--master-port", _free_port()), resumed)
    assert torch.load(resumed / "checkpoint.pt", weights_only=True)["epoch"] == 1
    rest = _tandem(*common, "--resume", "--out", str(resumed), "--master-port", _free_port())
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert "resuming after epoch 1" in rest.stdout, rest.stdout[:600]
    a, b = (torch.load(p / "checkpoint.pt", weights_only=True) for p in (straight, resumed))
    assert a["epoch"] == b["epoch"] == 2 and a["step"] == b["step"]
    for name, tensor in a["model"].items():
        torch.testing.assert_close(b["model"][name], tensor, rtol=0, atol=0, msg=name)
    assert [h["test_wer"] for h in a["history"]] == [h["test_wer"] for h in b["history"]]
    # a different configuration is refused, naming what differs, and the checkpoint is kept
    other = _tandem(*common, "--hidden", "32", "--resume", "--out", str(resumed), timeout=120)
    assert other.returncode == 2 and "model.hidden: checkpoint 96, now 32" in other.stderr, other.stderr
    kept = torch.load(resumed / "checkpoint.pt", weights_only=True)["model"]
    for name, tensor in b["model"].items():
        torch.testing.assert_close(kept[name], tensor, rtol=0, atol=0, msg=name)


def test_without_matplotlib_the_closing_line_names_only_what_was_written(tmp_path):
    blocker = tmp_path / "no-mpl" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('matplotlib is blocked for this test')\n")
    out = tmp_path / "run"
    done = _tandem(
        "--nproc", "1", "--epochs", "1", "--hidden", "16", "--layers", "1", "--out", str(out),
        pythonpath=(str(blocker.parent),),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "matplotlib is not installed" in done.stdout
    assert "wrote checkpoint.pt, metrics.json to" in done.stdout and "png" not in done.stdout.splitlines()[-1]
    assert not (out / "training_curve.png").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (("--test-speaker", "nobody"), "--test-speaker: expected one of george, jackson"),
        (("--data", "x.npz"), "--data: only for --task classify"),
        (("--warmup-steps", "-1"), "--warmup-steps: expected a number >= 0, got -1"),
        (("--task", "classify", "--test-speaker", "theo"), "--test-speaker: only for --task asr"),
    ],
)
def test_bad_options_are_refused_before_anything_is_written(tmp_path, args, message):
    out = tmp_path / "out"
    done = _tandem(*args, "--out", str(out), timeout=60)
    assert done.returncode == 2 and message in done.stderr
    assert not out.exists()


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
    done = _tandem("--resume", "--out", str(tmp_path / "empty"), timeout=60)
    assert done.returncode == 2 and "expected a checkpoint" in done.stderr
