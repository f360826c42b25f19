"""The benchmark runner on a tiny op registered here: rows, quantiles, speedups, filters, CSV, chart."""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import io
from pathlib import Path

import pytest
import torch

from tandem.bench import runner
from tandem.bench.registry import REGISTRY, OpBench, Shape, register

FAST = {"device": "cpu", "threads": 1, "min_time": 0.02, "progress": False}


def _matmul(scale: float):
    """Provider factory: one square matmul of side ``scale * params["n"]``, built outside the timing."""

    def factory(params, device, mode):
        n = int(scale * params["n"])
        a = torch.randn(n, n, device=device)
        return lambda: a @ a

    return factory


@pytest.fixture
def fake_mm():
    """Registers a two-provider matmul op for one test and restores the registry afterwards."""
    runner.discover()  # real bench modules register now, so restoring the snapshot never loses them
    saved = dict(REGISTRY)
    bench = register(
        OpBench(
            op="fake_mm",
            providers={"torch": _matmul(1.0), "tandem": _matmul(0.5)},
            shapes=(
                Shape("n64", {"n": 64}, quick=True),
                Shape("n96", {"n": 96}),
                Shape("n64-gpu-only", {"n": 64}, devices=("cuda",)),
            ),
            modes=("fwd",),
            description="a square matmul",
        )
    )
    yield bench
    REGISTRY.clear()
    REGISTRY.update(saved)


def _self_timed(seconds):
    return lambda params, device, mode: lambda: list(seconds)


def test_rows_quantiles_and_speedup(fake_mm):
    progress = io.StringIO()
    rows = runner.run_benchmarks(["fake_mm"], **{**FAST, "progress": progress})

    # n64-gpu-only is skipped on the CPU; both providers of both CPU shapes are timed.
    assert [(r.shape, r.provider) for r in rows] == [
        ("n64", "torch"),
        ("n64", "tandem"),
        ("n96", "torch"),
        ("n96", "tandem"),
    ]
    for row in rows:
        assert 0 < row.p20_ms <= row.p50_ms <= row.p80_ms
        assert (row.op, row.mode, row.torch_version) == ("fake_mm", "fwd", torch.__version__)
        assert row.device.startswith("cpu (1 thread, ")
        assert row.commit
    for base, other in (rows[0:2], rows[2:4]):
        assert base.speedup == 1.0
        assert other.speedup == pytest.approx(base.p50_ms / other.p50_ms)
    lines = progress.getvalue().splitlines()  # each case's start (it may take minutes), then its rows
    assert len(lines) == 6 and lines[0] == "[1/2] fake_mm n64 fwd: timing ..."
    assert (
        lines[1].startswith("[1/2] fake_mm n64 fwd torch: ")
        and lines[3] == "[2/2] fake_mm n96 fwd: timing ..."
    )
    assert lines[5].startswith("[2/2] fake_mm n96 fwd tandem: ")


def test_a_provider_that_does_not_apply_gets_no_row(fake_mm):
    """A factory returning None (a variant for another device) is left out of that case's rows, and out
    of the progress's count (which counted it, and stopped short of its total)."""
    fake_mm.providers["gpu-variant"] = lambda params, device, mode: None if device.type == "cpu" else 1
    progress = io.StringIO()
    rows = runner.run_benchmarks(["fake_mm"], quick=True, **{**FAST, "progress": progress})
    assert [(r.shape, r.provider) for r in rows] == [("n64", "torch"), ("n64", "tandem")]
    assert [line[:6] for line in progress.getvalue().splitlines()] == ["[1/1] "] * 3


def test_quick_keeps_only_quick_shapes(fake_mm):
    rows = runner.run_benchmarks(["fake_mm"], quick=True, **FAST)
    assert {r.shape for r in rows} == {"n64"}


def test_self_timed_op_uses_the_returned_seconds(fake_mm):
    register(
        OpBench(
            op="fake_selftimed",
            providers={
                "torch": _self_timed([0.006] * 3),
                "tandem": _self_timed([0.001, 0.002, 0.003, 0.004, 0.005]),
            },
            shapes=(Shape("w2", {}),),
            timing="self",
        )
    )
    base, row = runner.run_benchmarks(["fake_selftimed"], **FAST)
    assert (base.p20_ms, base.p50_ms, base.p80_ms) == pytest.approx((6.0, 6.0, 6.0))
    assert (row.p20_ms, row.p50_ms, row.p80_ms) == pytest.approx((1.8, 3.0, 4.2))  # linear interpolation
    assert row.speedup == pytest.approx(2.0)


def test_self_timed_thunk_must_return_seconds(fake_mm):
    register(OpBench("fake_bad", {"torch": lambda p, d, m: lambda: 0.5}, (Shape("s", {}),), timing="self"))
    with pytest.raises(TypeError, match="list of per-repeat seconds"):
        runner.run_benchmarks(["fake_bad"], **FAST)


def test_failing_provider_is_named(fake_mm):
    def broken(params, device, mode):
        raise ValueError("boom")

    register(OpBench("fake_broken", {"torch": _matmul(1.0), "tandem": broken}, (Shape("n8", {"n": 8}),)))
    with pytest.raises(RuntimeError, match="provider 'tandem' failed to build n8"):
        runner.run_benchmarks(["fake_broken"], **FAST)


def test_unknown_op_lists_the_available_ones(fake_mm):
    with pytest.raises(runner.BenchError, match=r"unknown op 'nope'; available: .*fake_mm"):
        runner.run_benchmarks(["nope"], **FAST)


def test_missing_bench_modules_are_skipped(fake_mm, monkeypatch):
    monkeypatch.setattr(runner, "KNOWN_OPS", (*runner.KNOWN_OPS, "not_an_op_module"))
    assert "fake_mm" in runner.discover()
    with pytest.raises(runner.BenchError, match="unknown op 'not_an_op_module'"):
        runner.discover(["not_an_op_module"])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        pytest.param({"threads": 0}, "threads: expected a positive integer, got 0", id="threads0"),
        pytest.param({"min_time": -1.0}, "min_time: expected a positive number", id="min-time-negative"),
        pytest.param({"device": "meta"}, "device: expected 'cpu' or 'cuda'", id="device-meta"),
    ],
)
def test_bad_arguments(fake_mm, kwargs, message):
    with pytest.raises(runner.BenchError, match=message):
        runner.run_benchmarks(["fake_mm"], **{**FAST, **kwargs})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_cuda_is_an_error(fake_mm):
    with pytest.raises(runner.BenchError, match="CUDA is not available"):
        runner.run_benchmarks(["fake_mm"], **{**FAST, "device": "cuda"})


def _rows(op="fake_mm", speedup=2.0):
    common = {"op": op, "mode": "fwd", "device": "cpu (1 thread, x)", "torch_version": "2.x", "commit": "abc"}
    return [
        runner.BenchRow(
            provider="torch", shape="n64", p50_ms=2.0, p20_ms=1.9, p80_ms=2.2, speedup=1.0, **common
        ),
        runner.BenchRow(
            provider="tandem", shape="n64", p50_ms=1.0, p20_ms=0.9, p80_ms=1.1, speedup=speedup, **common
        ),
    ]


def test_csv_header_columns_and_append(tmp_path):
    path = tmp_path / "bench.csv"
    runner.write_csv(_rows(), path)
    runner.write_csv(_rows(), path)  # appends, no second header
    lines = path.read_text().splitlines()
    assert lines[0] == "op,provider,mode,shape,p50_ms,p20_ms,p80_ms,device,torch_version,commit"
    assert len(lines) == 5
    records = list(csv.DictReader(path.open(newline="")))
    assert records[1]["provider"] == "tandem" and float(records[1]["p50_ms"]) == 1.0
    assert records[1]["device"] == "cpu (1 thread, x)"  # the comma inside is quoted


def test_csv_keeps_times_to_ten_nanoseconds():
    """A fast kernel's times: rounded to 10 ns (5 decimals of a millisecond), not to 0.0 ms."""
    row = dataclasses.replace(_rows()[1], p50_ms=0.0123456, p20_ms=0.0098765, p80_ms=12.3456789)
    record = row.csv_record()
    assert (record["p50_ms"], record["p20_ms"], record["p80_ms"]) == (0.01235, 0.00988, 12.34568)


def test_cuda_timing_reads_do_benchs_quantiles_in_the_order_it_asked_them(monkeypatch):
    """On CUDA, Triton's do_bench returns the quantiles in the order asked: (p20, p50, p80) come back
    sorted as their names say (no GPU needed: do_bench is stood in for)."""
    testing = pytest.importorskip("triton.testing")
    asked = []

    def do_bench(thunk, warmup, rep, quantiles):
        asked.append(quantiles)
        return [100.0 * q for q in quantiles]

    monkeypatch.setattr(testing, "do_bench", do_bench)
    timing = runner._Timing(min_time=0.01, warmup=0.01, rounds=1)
    assert runner._time_cuda(lambda: None, torch.device("cuda"), timing) == (20.0, 50.0, 80.0)
    assert len(asked) == 1


def test_csv_appends_after_a_last_line_without_its_newline(tmp_path):
    """A file whose last line has no line ending (written by hand, an editor): the first row went onto
    that line, and the next run refused the file."""
    path = tmp_path / "bench.csv"
    runner.write_csv(_rows(), path)
    path.write_bytes(path.read_bytes().rstrip(b"\r\n"))
    runner.write_csv(_rows(), path)
    records = list(csv.DictReader(path.open(newline="")))
    assert len(records) == 4 and [r["provider"] for r in records] == ["torch", "tandem"] * 2
    runner.check_csv(path)


def test_csv_refuses_a_file_with_other_columns(tmp_path):
    path = tmp_path / "other.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(runner.BenchError, match="has the header 'a,b'"):
        runner.write_csv(_rows(), path)
    assert path.read_text() == "a,b\n1,2\n"


def test_table_groups_ops_and_shows_speedup():
    table = runner.format_table(_rows() + _rows(op="other_op", speedup=0.5))
    lines = table.splitlines()
    assert lines[0].split() == ["op", "shape", "mode", "provider", "p50", "ms", "p20-p80", "ms", "speedup"]
    assert "" in lines  # a blank line between the two ops
    assert "2.00x" in table and "0.50x" in table and "1.900-2.200" in table


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "speedup.png"
    runner.plot_speedups(_rows() + _rows(op="other_op", speedup=0.5), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(not Path("/proc/version").is_file(), reason="needs Linux's /proc")
def test_csv_and_plot_that_cannot_be_written_are_refused_before_timing():
    """Places that take no file (here /proc, which refuses even root) are refused when checked, before
    anything is timed: a new file, an existing one that cannot be appended to, a chart."""
    for check, path, what in (
        (runner.check_csv, "/proc/tandem-bench.csv", "--csv"),
        (runner.check_plot, "/proc/tandem-bench.png", "--plot"),
    ):
        with pytest.raises(runner.BenchError, match=f"{what}: cannot write '{path}'"):
            check(path)
    assert not Path("/proc/tandem-bench.csv").exists()


def test_csv_that_is_no_text_or_under_a_file_is_refused_with_what_it_is(tmp_path):
    """A binary file raised UnicodeDecodeError; a parent that is a file was said not to exist."""
    binary = tmp_path / "chart.png"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    with pytest.raises(runner.BenchError, match=f"--csv: '{binary}' is not a CSV file"):
        runner.check_csv(binary)
    with pytest.raises(runner.BenchError, match=f"--csv: directory '{binary}' is a file, not a directory"):
        runner.check_csv(binary / "rows.csv")


def test_plot_checks_its_path(tmp_path):
    with pytest.raises(runner.BenchError, match="expected a .png file name"):
        runner.check_plot(tmp_path / "chart.jpg")
    with pytest.raises(runner.BenchError, match="does not exist"):
        runner.check_plot(tmp_path / "missing" / "chart.png")
