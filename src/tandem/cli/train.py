"""``tandem train``: a speech model on the bundled Japanese Vowels data (or ``--data``), data-parallel.

``--nproc N`` starts N processes through torchrun (``torch.distributed.run``): Gloo on CPUs, NCCL on
GPUs. Inside torchrun (``WORLD_SIZE`` set) this command is the worker itself, so multi-node runs are
``torchrun --nnodes ... -m tandem train ...`` with torchrun's usual options, or ``--nnodes``,
``--node-rank``, ``--master-addr`` and ``--master-port`` here.

Example::

    tandem train --epochs 20 --out runs/jv
    tandem train --resume --epochs 30 --out runs/jv      # continue the same run
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tandem.cli._args import positive_float, positive_int

__all__ = ["DESCRIPTION", "add_arguments", "run"]

DESCRIPTION = (
    "Train a DeepSpeech-style classifier (SyncBatchNorm, bidirectional GRU/LSTM, Adagrad, data parallel) "
    "on the bundled Japanese Vowels speaker data or your own --data file; writes metrics.json, a "
    "training-curve PNG and a checkpoint to --out."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tandem train``."""
    parser.add_argument(
        "--cell", choices=("gru", "lstm"), default="gru", help="recurrent cell (default: gru)"
    )
    parser.add_argument(
        "--hidden", type=positive_int, default=64, help="hidden size per direction (default: 64)"
    )
    parser.add_argument("--layers", type=positive_int, default=2, help="recurrent layers (default: 2)")
    parser.add_argument("--epochs", type=positive_int, default=20, help="epochs in total (default: 20)")
    parser.add_argument(
        "--lr", type=positive_float, default=0.05, help="Adagrad learning rate (default: 0.05)"
    )
    parser.add_argument(
        "--batch-size", type=positive_int, default=32, help="global batch, split over processes (default: 32)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument(
        "--out", type=Path, default=Path("runs/train"), help="output folder (default: runs/train)"
    )
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    parser.add_argument(
        "--data",
        type=Path,
        default=None,
        help="a .npz with features [N,T,F], lengths [N], labels [N], optional split [N] (see tandem.data)",
    )
    parser.add_argument(
        "--nproc", type=positive_int, default=2, help="data-parallel processes on this machine (default: 2)"
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: auto")
    parser.add_argument("--nnodes", type=positive_int, default=1, help="torchrun: machines (default: 1)")
    parser.add_argument("--node-rank", type=int, default=0, help="torchrun: this machine's rank")
    parser.add_argument("--master-addr", default="127.0.0.1", help="torchrun: rank 0's address")
    parser.add_argument("--master-port", type=positive_int, default=29500, help="torchrun: rank 0's port")
    parser.add_argument(
        "--timeout", type=positive_float, default=60.0, help="collective timeout, s (default: 60)"
    )


def _fail(parser: argparse.ArgumentParser, message: str) -> int:
    parser.print_usage(sys.stderr)
    print(f"tandem train: error: {message}", file=sys.stderr)
    return 2


def _check_out(out: Path, resume: bool) -> str | None:
    """Why ``out`` cannot take this run's files, or None. Creates the folder, writes nothing else."""
    if out.exists() and not out.is_dir():
        return f"--out {out}: expected a folder, found a file"
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".tandem-write-test-"):
            pass
    except OSError as e:
        return f"--out {out}: cannot write there ({e.strerror or e})"
    if resume and not (out / "checkpoint.pt").is_file():
        return f"--resume: expected a checkpoint at {out / 'checkpoint.pt'}, found none"
    return None


# Options only the launcher reads; the workers learn their world from torchrun's environment.
_LAUNCHER_OPTIONS = ("nproc", "nnodes", "node_rank", "master_addr", "master_port")


def _worker_argv(args: argparse.Namespace) -> list[str]:
    """The workers' options as ``--name=value``: torchrun's parser prefix-matches any ``--name`` it sees
    (``--nproc`` is "ambiguous" with its ``--nproc-per-node``), so launcher options are not forwarded."""
    argv = []
    for action in _train_parser_actions():
        if action.dest in _LAUNCHER_OPTIONS or not action.option_strings or action.dest == "help":
            continue
        value = getattr(args, action.dest)
        if isinstance(action, argparse._StoreTrueAction):
            argv += [action.option_strings[0]] if value else []
        elif value is not None:
            argv.append(f"{action.option_strings[0]}={value}")
    return argv


def _train_parser_actions() -> list[argparse.Action]:
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return parser._actions


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Validate everything, then train here (under torchrun, or one process) or launch torchrun."""
    from tandem.data import JAPANESE_VOWELS, load_npz

    if "WORLD_SIZE" in os.environ:  # we are a torchrun worker: the launcher validated the arguments
        from tandem.cli._train_worker import train

        return train(args)

    # Everything a run could trip on is checked before anything is written or launched.
    try:
        load_npz(args.data or JAPANESE_VOWELS)
    except ValueError as e:
        return _fail(parser, str(e))
    if not 0 <= args.node_rank < args.nnodes:
        return _fail(parser, f"--node-rank: expected a value in [0, {args.nnodes - 1}], got {args.node_rank}")
    problem = _check_out(args.out, args.resume)
    if problem:
        return _fail(parser, problem)

    if args.nproc == 1 and args.nnodes == 1:
        from tandem.cli._train_worker import train

        return train(args)

    if args.nnodes == 1:
        rendezvous = ["--standalone"]
    else:
        rendezvous = [
            f"--nnodes={args.nnodes}",
            f"--node-rank={args.node_rank}",
            f"--master-addr={args.master_addr}",
            f"--master-port={args.master_port}",
        ]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *rendezvous,
        f"--nproc-per-node={args.nproc}",
        "-m",
        "tandem",
        "train",
        *_worker_argv(args),
    ]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.call(command, env=env)
