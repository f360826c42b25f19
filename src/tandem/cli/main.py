"""``tandem`` / ``python -m tandem``: the command line (subcommands train, transcribe, bench)."""

from __future__ import annotations

import argparse
import shlex
import sys

import tandem
from tandem.cli import bench, train, transcribe

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``tandem`` parser; each subcommand's module adds its options and runs it."""
    parser = argparse.ArgumentParser(prog="tandem", description="tandem: fast training of recurrent models.")
    parser.add_argument("--version", action="version", version=f"tandem {tandem.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{train,transcribe,bench}")
    for name, module, summary in (
        ("train", train, "train the speech recognizer (bundled digits or your manifests), data-parallel"),
        ("transcribe", transcribe, "transcribe recordings with a trained recognizer: path<TAB>text"),
        ("bench", bench, "time tandem against PyTorch: table, CSV, chart"),
    ):
        sub = commands.add_parser(name, help=summary, description=module.DESCRIPTION)
        module.add_arguments(sub)
        sub.set_defaults(handler=module.run, subparser=sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # in the subcommand's usage (the top-level parser's named no option of it)
        args.subparser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.argv = argv
    args.command_line = shlex.join(["tandem", *argv])
    return args.handler(args, args.subparser)


if __name__ == "__main__":
    sys.exit(main())
