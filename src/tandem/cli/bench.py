"""``tandem bench``: time tandem against its PyTorch counterparts (the registry in ``tandem.bench``).

Prints one table (p50, p20-p80 spread and speedup over the baseline per op, shape, mode and provider)
to stdout and progress to stderr (a line as each case starts, one per provider timed); ``--csv``
appends rows, ``--plot`` draws a bar chart of the speedups.

Example::

    tandem bench --op gru --threads 2 --csv bench.csv --plot bench.png
    python -m benchmarks.run --op gru --quick
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
from collections.abc import Callable

from tandem.bench import runner
from tandem.cli._args import nonempty_path, positive_float, threads
from tandem.cli._output import to_null_device

__all__ = ["DESCRIPTION", "add_arguments", "run", "main"]

DESCRIPTION = (
    "Time tandem against its PyTorch counterparts, every provider of a shape side by side: one table "
    "with the median (p50), the p20-p80 spread and the speedup over the baseline; --csv appends rows, "
    "--plot draws the speedups."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tandem bench`` (shared with ``python -m benchmarks.run``)."""
    parser.add_argument(
        "--op",
        dest="ops",
        action="extend",
        nargs="+",
        metavar="OP",
        help=f"op(s) to time, repeatable (default: every registered one of {', '.join(runner.KNOWN_OPS)})",
    )
    parser.add_argument("--quick", action="store_true", help="only the quick shapes, with shorter timing")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), help="where to run (default: cuda when available, else cpu)"
    )
    parser.add_argument(
        "--threads", type=threads, default=2, metavar="N", help="torch CPU threads (default: 2)"
    )
    parser.add_argument(
        "--min-time",
        type=positive_float,
        metavar="S",
        help="seconds of measurement per provider and case (default: 1.0, or 0.3 with --quick); the ops "
        "that time themselves (train, syncbn, ddp) run their shapes' fixed steps whatever it says",
    )
    parser.add_argument(
        "--csv", type=nonempty_path, metavar="FILE", help="append the rows to this CSV file (header if new)"
    )
    parser.add_argument(
        "--plot",
        type=nonempty_path,
        metavar="FILE.png",
        help="write a bar chart of the speedups (needs matplotlib)",
    )
    parser.add_argument(
        "--list", action="store_true", help="list the registered ops and shapes, time nothing"
    )


def _list(ops: list[str] | None) -> str:
    lines = []
    for name in runner.discover(ops):
        bench = runner.REGISTRY[name]
        providers = ", ".join(f"{p} (baseline)" if p == bench.baseline else p for p in bench.providers)
        lines.append(f"{name}: {bench.description}".rstrip(": "))
        lines.append(f"  providers: {providers}; modes: {', '.join(bench.modes)}")
        for shape in bench.shapes:
            tags = ", ".join((["quick"] if shape.quick else []) + list(shape.devices))
            lines.append(f"  {shape.id}  [{tags}]")
    return "\n".join(lines)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``tandem bench`` with parsed ``args``; usage problems go to ``parser.error`` (exit 2)."""
    try:
        if args.list:
            ignored = [f"--{k.replace('_', '-')}" for k in ("csv", "plot", "min_time") if getattr(args, k)]
            if ignored:
                parser.error(f"--list times nothing: {', '.join(ignored)} would have no effect")
            return _to_stdout(lambda: print(_list(args.ops), flush=True))
        # Output files are checked before the (minute-long) timing, not after it.
        if args.csv and args.plot and os.path.realpath(args.csv) == os.path.realpath(args.plot):
            parser.error(
                f"--csv and --plot name the same file ({args.plot}): the chart would replace the rows"
            )
        if args.csv:
            runner.check_csv(args.csv)
        if args.plot:
            runner.check_plot(args.plot)
        started = datetime.datetime.now().astimezone()
        rows = runner.run_benchmarks(
            args.ops, device=args.device, threads=args.threads, quick=args.quick, min_time=args.min_time
        )
    except runner.BenchError as e:
        parser.error(str(e))

    first = rows[0] if rows else None
    if first is None:  # before a file is written
        ops = ", ".join(args.ops) if args.ops else "every op"
        parser.error(
            f"--op {ops}: nothing to time on {args.device or 'this device'}"
            f"{' with --quick' if args.quick else ''} (no shape of theirs runs there; --list shows them)"
        )

    def table() -> None:
        print(
            f"tandem bench on {first.device}, torch {first.torch_version}, commit {first.commit}, "
            f"{started:%Y-%m-%d %H:%M %Z}"
        )
        print(f"command: {getattr(args, 'command_line', parser.prog)}")
        print()
        print(runner.format_table(rows))
        for op in dict.fromkeys(r.op for r in rows):
            # An op may add lines of its own under the table (ddp: overlap efficiency and overhead).
            summarize = runner.REGISTRY[op].extra.get("summary") if op in runner.REGISTRY else None
            if summarize is not None:
                print()
                print(summarize([r for r in rows if r.op == op]))
        sys.stdout.flush()

    code = _to_stdout(table)
    # the files after the table, each on its own: a disk that fills (checked writable before the timing)
    # costs that file alone, with one line, not the measurements in a traceback
    for option, path, write in (
        ("--csv", args.csv, lambda: runner.write_csv(rows, args.csv)),
        ("--plot", args.plot, lambda: runner.plot_speedups(rows, args.plot)),
    ):
        if not path:
            continue
        try:
            write()
        except OSError as e:
            print(f"tandem bench: error: {option} {path}: not written ({e.strerror or e})", file=sys.stderr)
            code = 1
        else:
            print(
                f"wrote {len(rows)} rows to {path}" if option == "--csv" else f"wrote {path}", file=sys.stderr
            )
    return code


def _to_stdout(write: Callable[[], None]) -> int:
    """Run ``write`` (printing to standard output): 0, or 1 with one line on stderr where standard output
    fails (``> /dev/full``: a traceback); a reader that leaves early (``| head``) ends it quietly."""
    try:
        write()
    except BrokenPipeError:
        to_null_device(sys.stdout)
    except OSError as e:
        to_null_device(sys.stdout)
        print(f"tandem bench: error: writing to standard output: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks.run") -> int:
    """Entry point for ``python -m benchmarks.run``: the same options as ``tandem bench``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.command_line = shlex.join([*prog.split(), *argv])
    return run(args, parser)
