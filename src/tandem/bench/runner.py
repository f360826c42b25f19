"""Runs the benchmark registry: every provider of a shape timed side by side, one table, CSV and a chart.

How an op takes part: a module ``tandem.bench.<op>`` (one of :data:`KNOWN_OPS`) calls
:func:`tandem.bench.registry.register` at import. Each provider is a factory
``(params, device, mode) -> thunk``; the factory's work (modules, inputs, optimizer state) is not timed,
the zero-argument thunk is one measured unit (for example one training step). With ``timing="self"``
the thunk measures itself (multi-process benchmarks) and returns a list of per-repeat seconds; the
runner calls it once and does no warm-up for it.

Example::

    rows = run_benchmarks(["gru"], quick=True)
    print(format_table(rows))
    write_csv(rows, "bench.csv")
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import gc
import importlib
import numbers
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from tandem.bench.registry import REGISTRY, OpBench, Shape

__all__ = [
    "KNOWN_OPS",
    "CSV_COLUMNS",
    "BenchError",
    "BenchRow",
    "discover",
    "run_benchmarks",
    "format_table",
    "write_csv",
    "check_csv",
    "plot_speedups",
    "check_plot",
    "device_description",
    "git_commit",
]

# Modules tandem.bench.<name> that register an op; the ones not (yet) in this checkout are skipped.
KNOWN_OPS: tuple[str, ...] = ("gru", "lstm", "adagrad", "syncbn", "ddp", "train", "transcribe")
CSV_COLUMNS: tuple[str, ...] = (
    "op",
    "provider",
    "mode",
    "shape",
    "p50_ms",
    "p20_ms",
    "p80_ms",
    "device",
    "torch_version",
    "commit",
)
QUANTILES = (0.2, 0.5, 0.8)


class BenchError(ValueError):
    """A problem with what was asked (unknown op, no CUDA, bad output file), raised before any timing."""


@dataclass
class BenchRow:
    """One measured case: the CSV columns, plus ``speedup = baseline p50 / this p50`` for the table."""

    op: str
    provider: str
    mode: str
    shape: str
    p50_ms: float
    p20_ms: float
    p80_ms: float
    device: str
    torch_version: str
    commit: str
    speedup: float = float("nan")

    def csv_record(self) -> dict[str, Any]:
        # Times to 10 ns: finer digits are noise, and the file stays readable.
        return {
            name: round(v, 5) if name.endswith("_ms") else v
            for name, v in dataclasses.asdict(self).items()
            if name in CSV_COLUMNS
        }


@dataclass(frozen=True)
class _Timing:
    """How long to warm up and measure each provider of a case; ``rounds`` interleave the providers."""

    min_time: float  # seconds of measurement per provider and case, split over the rounds
    warmup: float  # seconds of warm-up per provider and case (at least two calls)
    rounds: int


def _timing(quick: bool, min_time: float | None) -> _Timing:
    if min_time is not None and not min_time > 0:
        raise BenchError(f"min_time: expected a positive number of seconds, got {min_time}")
    # An explicit short min_time (a smoke run) also shortens the warm-up; two calls always happen.
    if quick:
        measure = min_time or 0.3
        return _Timing(min_time=measure, warmup=min(0.1, measure), rounds=2)
    measure = min_time or 1.0
    return _Timing(min_time=measure, warmup=min(0.3, measure), rounds=4)


# --------------------------------------------------------------------------------------------------
# discovery


def _import_bench_module(name: str, *, required: bool) -> None:
    module = f"tandem.bench.{name}"
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:  # the module itself is absent: that op is not in this checkout
            return
        _import_failed(module, e, required)
    except Exception as e:  # a present but broken module must not hide the other ops' benchmarks
        _import_failed(module, e, required)


def _import_failed(module: str, error: Exception, required: bool) -> None:
    if required:
        raise BenchError(f"could not import {module}: {type(error).__name__}: {error}") from error
    print(f"tandem bench: skipping {module}: {type(error).__name__}: {error}", file=sys.stderr)


def discover(ops: Sequence[str] | None = None) -> list[str]:
    """Import the bench modules that fill :data:`REGISTRY` and return the names of the ops to run.

    ``ops=None`` means every registered op (in :data:`KNOWN_OPS` order, then the others). A requested
    op that nothing registers raises :class:`BenchError` naming the available ones.
    """
    if ops is None:
        for name in KNOWN_OPS:
            _import_bench_module(name, required=False)
        ordered = [name for name in KNOWN_OPS if name in REGISTRY]
        return ordered + sorted(name for name in REGISTRY if name not in KNOWN_OPS)

    wanted = list(dict.fromkeys(ops))  # keep the user's order, drop repeats
    for name in wanted:
        if name in REGISTRY:
            continue
        if name in KNOWN_OPS:
            _import_bench_module(name, required=True)
        else:  # an op may be registered by a module of another name: look everywhere first
            for known in KNOWN_OPS:
                _import_bench_module(known, required=False)
    missing = [name for name in wanted if name not in REGISTRY]
    if missing:
        available = ", ".join(discover()) or "none (no tandem.bench.<op> module is present)"
        raise BenchError(f"unknown op {missing[0]!r}; available: {available}")
    return wanted


# --------------------------------------------------------------------------------------------------
# environment


def git_commit() -> str:
    """Short hash of the checkout tandem is imported from (``-dirty`` if tracked files changed)."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=10, check=True)
        return out.stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{commit}-dirty" if dirty else commit


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def device_description(device: torch.device, threads: int) -> str:
    """``"cpu (2 threads, AMD EPYC)"`` or the CUDA device's name."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({threads} thread{'s' if threads > 1 else ''}, {_cpu_model()})"


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise BenchError(f"device: expected 'cpu' or 'cuda', got {str(dev)!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BenchError(
            f"device: 'cuda' was asked for but CUDA is not available (torch {torch.__version__})"
        )
    return dev


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# --------------------------------------------------------------------------------------------------
# timing


def _quantiles_ms(seconds: Sequence[float]) -> tuple[float, float, float]:
    """(p20, p50, p80) in ms of per-call times given in seconds."""
    samples = torch.tensor(list(seconds), dtype=torch.float64) * 1e3
    q = samples.quantile(torch.tensor(QUANTILES, dtype=torch.float64))
    return float(q[0]), float(q[1]), float(q[2])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _warm_up(thunk: Callable[[], Any], device: torch.device, seconds: float) -> None:
    # The first calls pay for lazy initialisation (allocator, oneDNN primitives, Triton compiles).
    start, calls = time.perf_counter(), 0
    while calls < 2 or time.perf_counter() - start < seconds:
        thunk()
        _sync(device)
        calls += 1


def _time_cpu_round(thunk: Callable[[], Any], threads: int, seconds: float) -> list[float]:
    """Per-call seconds of ``thunk`` for about ``seconds`` (at least four blocks), pinned to ``threads``."""
    from torch.utils.benchmark import Timer

    timer = Timer(stmt="thunk()", globals={"thunk": thunk}, num_threads=threads)
    # adaptive_autorange always takes more than three blocks (a median needs them) and stops between
    # ``seconds`` and twice that, earlier only if the spread is already small.
    measurement = timer.adaptive_autorange(threshold=0.05, min_run_time=seconds, max_run_time=2 * seconds)
    return list(measurement.times)


def _time_cuda(thunk: Callable[[], Any], device: torch.device, timing: _Timing) -> tuple[float, ...]:
    """(p20, p50, p80) in ms on a CUDA device: Triton's do_bench if it imports, else CUDA events."""
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        p50, p20, p80 = do_bench(
            thunk,
            warmup=max(1, int(timing.warmup * 1e3)),
            rep=max(1, int(timing.min_time * 1e3)),
            quantiles=[0.5, 0.2, 0.8],
        )
        return p20, p50, p80

    with torch.cuda.device(device):
        _warm_up(thunk, device, timing.warmup)
        pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        start = time.perf_counter()
        while len(pairs) < 10 or time.perf_counter() - start < timing.min_time:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            thunk()
            end.record()
            pairs.append((begin, end))
        torch.cuda.synchronize(device)
    return _quantiles_ms([begin.elapsed_time(end) * 1e-3 for begin, end in pairs])


def _self_timed(bench: OpBench, provider: str, thunk: Callable[[], Any]) -> tuple[float, ...]:
    seconds = thunk()
    ok = isinstance(seconds, (list, tuple)) and len(seconds) > 0
    ok = ok and all(isinstance(s, numbers.Real) and s >= 0 for s in seconds)
    if not ok:
        raise TypeError(
            f"bench {bench.op!r}, provider {provider!r}: a timing='self' thunk must return a non-empty list "
            f"of per-repeat seconds, got {seconds!r:.80}"
        )
    return _quantiles_ms(seconds)


def _measure_case(
    bench: OpBench, shape: Shape, mode: str, device: torch.device, threads: int, timing: _Timing
) -> dict[str, tuple[float, ...]]:
    """(p20, p50, p80) in ms for every provider of one (shape, mode), all built and timed together."""
    thunks = {}
    for name, factory in bench.providers.items():
        try:
            thunk = factory(dict(shape.params), device, mode)
            if thunk is not None:  # None: this provider does not apply to this case
                thunks[name] = thunk
        except Exception as e:
            raise RuntimeError(
                f"bench {bench.op!r}: provider {name!r} failed to build {shape.id} ({mode}): "
                f"{type(e).__name__}: {e}"
            ) from e
    _sync(device)

    names = list(thunks)
    if bench.timing not in ("timer", "self"):
        raise ValueError(f"bench {bench.op!r}: timing must be 'timer' or 'self', got {bench.timing!r}")
    if bench.timing == "self":
        return {name: _self_timed(bench, name, thunks[name]) for name in names}
    if device.type == "cuda":
        return {name: _time_cuda(thunks[name], device, timing) for name in names}

    for name in names:
        _warm_up(thunks[name], device, timing.warmup)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(timing.rounds):
        # Rotating the order spreads slow drifts (thermal, the neighbours' load) over all providers.
        for name in names[r % len(names) :] + names[: r % len(names)]:
            samples[name] += _time_cpu_round(thunks[name], threads, timing.min_time / timing.rounds)
    return {name: _quantiles_ms(samples[name]) for name in names}


def run_benchmarks(
    ops: Sequence[str] | None = None,
    *,
    device: str | torch.device | None = None,
    threads: int = 2,
    quick: bool = False,
    min_time: float | None = None,
    progress: TextIO | bool = True,
) -> list[BenchRow]:
    """Time every registered provider of ``ops`` (all registered ops if None) and return one row each.

    Args:
        ops: op names (``["gru", "adagrad"]``); see :func:`discover`.
        device: ``"cpu"`` or ``"cuda"``; None picks CUDA when it is available.
        threads: torch's CPU thread count while building, warming up and timing.
        quick: only the shapes marked ``quick=True``, with shorter timing.
        min_time: seconds of measurement per provider and case (default 1.0, or 0.3 with ``quick``).
        progress: where to print a line as each case starts and one per provider it timed: True for
            stderr, False for nowhere.

    Returns:
        Rows in op, shape, mode, provider order; ``speedup`` is the baseline's p50 over the row's.

    Example::

        rows = run_benchmarks(["gru"], device="cpu", threads=2, quick=True)
    """
    if threads < 1:
        raise BenchError(f"threads: expected a positive integer, got {threads}")
    timing = _timing(quick, min_time)
    log = sys.stderr if progress is True else progress or None
    dev = _resolve_device(device)
    names = discover(ops)
    if not names:
        raise BenchError(
            f"no benchmarks are registered: no module tandem.bench.{{{','.join(KNOWN_OPS)}}} is present"
        )

    plan: list[tuple[OpBench, Shape, str]] = []
    for name in names:
        bench = REGISTRY[name]
        shapes = [s for s in bench.shapes if dev.type in s.devices and (s.quick or not quick)]
        if not shapes and log is not None:
            print(f"tandem bench: {name}: no {'quick ' if quick else ''}shapes for {dev.type}", file=log)
        plan += [(bench, shape, mode) for shape in shapes for mode in bench.modes]

    description = device_description(dev, threads)
    env = {"device": description, "torch_version": torch.__version__, "commit": git_commit()}
    rows: list[BenchRow] = []
    with _torch_threads(threads):
        # progress counts cases (a provider may not apply to one: the rows are known once it is timed)
        for case, (bench, shape, mode) in enumerate(plan, 1):
            if log is not None:  # before the timing: a case may take minutes (the whole training job)
                print(f"[{case}/{len(plan)}] {bench.op} {shape.id} {mode}: timing ...", file=log, flush=True)
            result = _measure_case(bench, shape, mode, dev, threads, timing)
            base_p50 = result[bench.baseline][1]
            for provider, (p20, p50, p80) in result.items():
                row = BenchRow(bench.op, provider, mode, shape.id, p50, p20, p80, **env)
                row.speedup = base_p50 / p50 if p50 > 0 else float("nan")
                rows.append(row)
                if log is not None:
                    print(
                        f"[{case}/{len(plan)}] {bench.op} {shape.id} {mode} {provider}: {p50:.3f} ms "
                        f"(p20-p80 {p20:.3f}-{p80:.3f}), {row.speedup:.2f}x",
                        file=log,
                        flush=True,
                    )
            gc.collect()  # free this case's models before the next one is built
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------------------------------
# output


def _ms(x: float) -> str:
    return f"{x:.3f}" if x < 100 else f"{x:.1f}"


def _spread(row: BenchRow) -> str:
    return f"{_ms(row.p20_ms)}-{_ms(row.p80_ms)}"


def format_table(rows: Sequence[BenchRow]) -> str:
    """A fixed-width table, one block per op: op, shape, mode, provider, p50 ms, p20-p80 ms, speedup."""
    header = ("op", "shape", "mode", "provider", "p50 ms", "p20-p80 ms", "speedup")
    body = [(r.op, r.shape, r.mode, r.provider, _ms(r.p50_ms), _spread(r), f"{r.speedup:.2f}x") for r in rows]
    widths = [max(len(cell) for cell in column) for column in zip(header, *body)]
    right = {4, 5, 6}  # numbers are right-aligned

    def line(cells: Sequence[str]) -> str:
        padded = (c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return "  ".join(padded)

    out = [line(header), "  ".join("-" * w for w in widths)]
    for i, cells in enumerate(body):
        if i and rows[i].op != rows[i - 1].op:
            out.append("")
        out.append(line(cells))
    return "\n".join(s.rstrip() for s in out)


def check_csv(path: str | os.PathLike[str]) -> None:
    """Raise :class:`BenchError` now if rows could not be written or appended to ``path`` later."""
    p = Path(path)
    if p.is_dir():
        raise BenchError(f"--csv: {str(p)!r} is a directory")
    if not p.parent.is_dir():
        missing = "is a file, not a directory" if p.parent.exists() else "does not exist"
        raise BenchError(f"--csv: directory {str(p.parent)!r} {missing}")
    if p.exists() and p.stat().st_size > 0:
        try:
            with p.open(newline="", encoding="utf-8") as f:
                first = next(csv.reader(f), [])
        except (UnicodeDecodeError, csv.Error) as e:
            raise BenchError(f"--csv: {str(p)!r} is not a CSV file ({e}); rows are appended to one") from None
        if tuple(first) != CSV_COLUMNS:
            raise BenchError(
                f"--csv: {str(p)!r} has the header {','.join(first)!r}, expected {','.join(CSV_COLUMNS)!r} "
                "(rows are only appended to a file with the same columns)"
            )
    _check_writable(p, "--csv")


def _check_writable(p: Path, what: str) -> None:
    """Raise :class:`BenchError` now if ``p`` could not be written later (a read-only file system, a
    folder that takes no files): opened for appending where it exists, a scratch file beside it where it
    does not (removed at once); nothing changes."""
    try:
        if p.exists():
            with p.open("ab"):
                pass
        else:
            with tempfile.NamedTemporaryFile(dir=p.parent, prefix=".tandem-bench-write-test-"):
                pass
    except OSError as e:
        raise BenchError(f"{what}: cannot write {str(p)!r} ({e.strerror or e})") from None


def write_csv(rows: Sequence[BenchRow], path: str | os.PathLike[str]) -> None:
    """Append ``rows`` to ``path`` with the columns :data:`CSV_COLUMNS` (header written if new or empty)."""
    check_csv(path)
    p = Path(path)
    new = not p.exists() or p.stat().st_size == 0
    ends_open = not new and not p.read_bytes().endswith((b"\n", b"\r"))  # (an editor's last line)
    with p.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        if new:
            writer.writeheader()
        elif ends_open:
            f.write("\r\n")  # the csv module's line ending: the first row must not join the last line
        for row in rows:
            writer.writerow(row.csv_record())


def check_plot(path: str | os.PathLike[str]) -> None:
    """Raise :class:`BenchError` now if a chart could not be written to ``path`` later."""
    p = Path(path)
    if p.suffix.lower() != ".png":
        raise BenchError(f"--plot: expected a .png file name, got {str(p)!r}")
    if not p.parent.is_dir():
        missing = "is a file, not a directory" if p.parent.exists() else "does not exist"
        raise BenchError(f"--plot: directory {str(p.parent)!r} {missing}")
    _check_writable(p, "--plot")
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise BenchError("--plot needs matplotlib: pip install 'tandem[plot]' (or matplotlib)") from e


def plot_speedups(rows: Sequence[BenchRow], path: str | os.PathLike[str]) -> None:
    """A PNG bar chart: per op, the speedup of each non-baseline provider per shape; baseline at 1.0."""
    check_plot(path)
    from matplotlib.figure import Figure  # a bare Figure renders with Agg and leaves pyplot's state alone

    ops = list(dict.fromkeys(r.op for r in rows))
    # shape ids are long: rotated labels, and room for them below each panel
    fig = Figure(figsize=(10, 4.6 * max(1, len(ops))), layout="constrained")
    axes = fig.subplots(max(1, len(ops)), 1, squeeze=False)[:, 0]
    for ax, op in zip(axes, ops):
        op_rows = [r for r in rows if r.op == op]
        multi_mode = len({r.mode for r in op_rows}) > 1
        cases = list(dict.fromkeys((r.shape, r.mode) for r in op_rows))
        providers = list(dict.fromkeys(r.provider for r in op_rows))
        if op in REGISTRY:
            base = REGISTRY[op].baseline
        else:  # rows of an op no longer registered: its baseline is the provider at 1.0x everywhere
            at_one = [p for p in providers if all(r.speedup == 1.0 for r in op_rows if r.provider == p)]
            base = at_one[0] if at_one else None
        others = [p for p in providers if p != base]
        width = 0.8 / max(1, len(others))
        for k, provider in enumerate(others):
            by_case = {(r.shape, r.mode): r.speedup for r in op_rows if r.provider == provider}
            xs = [i + (k - (len(others) - 1) / 2) * width for i in range(len(cases))]
            ys = [by_case.get(case, float("nan")) for case in cases]
            bars = ax.bar(xs, ys, width=width, label=provider)
            ax.bar_label(bars, labels=[f"{y:.2f}x" for y in ys], fontsize=8)
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label=f"{base or 'baseline'} (1.0x)")
        ax.set_xticks(range(len(cases)))
        labels = [f"{s} {m}" if multi_mode else s for s, m in cases]
        ax.set_xticklabels(labels, fontsize=8, rotation=30, ha="right", rotation_mode="anchor")
        ax.set_ylabel("speedup (p50)")
        ax.margins(y=0.12)  # room for the bar labels
        ax.set_title(op)
        ax.legend(fontsize=8, loc="best")
    if rows:
        first = rows[0]
        fig.suptitle(f"tandem bench: {first.device}, torch {first.torch_version}, {first.commit}", fontsize=9)
    fig.savefig(path, format="png", dpi=120)
