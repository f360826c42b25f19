"""The scripts a session with a lent GPU runs first (benchmarks/gpu_session.sh and what it calls): device
time is scarce, so they are run here as far as a CPU can, and a broken one shows in CI rather than on
the GPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem import _backend

ROOT = Path(__file__).resolve().parents[2]


def test_the_session_script_parses():
    done = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_session.sh")], capture_output=True)
    assert done.returncode == 0, done.stderr


def test_the_profile_script_parses_its_arguments():
    script = ROOT / "benchmarks" / "gpu_profile.py"
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--loops" in done.stdout, done.stderr


def _sweep_dry_run(*args: str) -> subprocess.CompletedProcess:
    """benchmarks/gpu_sweep_bwd.py with ``args`` on the CPU, in float64 under Triton's interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="1", TANDEM_FORCE_TRITON="1", PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu_sweep_bwd.py"),
            "--device",
            "cpu",
            "--dtype",
            "float64",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.skipif(not _backend.triton_available(), reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the sweep runs compiled on it")
@pytest.mark.timeout(300)
def test_the_backward_sweep_runs_under_the_interpreter():
    """Both cells' sweeps, on a tiny float64 layer under Triton's interpreter: every variant builds, runs
    and gives the default blocks' gradients."""
    done = _sweep_dry_run("--shape", "T3-B4-I8-H16", "--blocks", "16", "--warps", "4")
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines if "default" in line] == ["gru", "lstm"], done.stdout
    variants = [line for line in lines if "rel. diff" in line]
    assert len(variants) == 4 and "failed" not in done.stdout, done.stdout  # (J16 K16, J16 K128) per cell
    assert all(float(re.search(r"rel. diff (\S+)", line).group(1)) < 1e-12 for line in variants), done.stdout


@pytest.mark.skipif(not _backend.triton_available(), reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the comparison runs compiled on it")
@pytest.mark.timeout(300)
def test_the_split_step_comparison_runs_under_the_interpreter_at_several_shapes():
    """``--split --no-product-sweep`` over two shapes (the session's "split-sizes"): both steps of both
    cells at each, the same gradients."""
    done = _sweep_dry_run("--split", "--no-product-sweep", "--shape", "T3-B4-I8-H16", "T2-B3-I4-H8")
    lines = done.stdout.splitlines()
    assert [line for line in lines if line.startswith("shape")] == ["shape T3-B4-I8-H16", "shape T2-B3-I4-H8"]
    ratios = [line for line in lines if "x the fused" in line]
    assert [line.split()[0] for line in ratios] == ["gru", "lstm"] * 2, done.stdout
    steps = [line for line in lines if "rel. diff" in line]
    assert len(steps) == 8 and "product" not in done.stdout, done.stdout
    assert all(float(re.search(r"rel. diff (\S+)", line).group(1)) < 1e-12 for line in steps), done.stdout
