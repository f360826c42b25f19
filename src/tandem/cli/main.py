"""``tandem`` / ``python -m tandem``: the command line (subcommands train, transcribe, bench)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import TextIO

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


def _null_for_closed_standard_streams() -> None:
    """A standard stream closed at the start (``2>&-``, ``>&-``) gets the null device: its descriptor, so
    that no file opened later takes the number (what is written to descriptor 2 would land in it), and
    for stderr its Python stream too, since print(file=None) writes to stdout (error lines would land in
    the transcripts). A closed stdout stays None in Python: ``tandem transcribe`` refuses it (nowhere to
    write the transcripts); the other commands write their files and lose only their messages."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free descriptor: this one
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            os.set_inheritable(fd, True)  # as a standard stream is: torchrun's workers start with it
    if sys.stderr is None:
        sys.stderr = _null_stream()


def _null_stream() -> TextIO:
    """One text stream to the null device for the process (main() may run more than once in it)."""
    global _NULL
    if _NULL is None:
        # (backslashreplace, as Python's stderr: a file name that is not UTF-8 must not fail a message)
        _NULL = open(os.devnull, "w", encoding="utf-8", errors="backslashreplace")  # noqa: SIM115
    return _NULL


_NULL: TextIO | None = None


def main(argv: list[str] | None = None) -> int:
    _null_for_closed_standard_streams()
    argv = sys.argv[1:] if argv is None else list(argv)
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # in the subcommand's usage (the top-level parser's named no option of it)
        args.subparser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if sys.stdout is None and args.command != "transcribe":  # (see _null_for_closed_standard_streams)
        sys.stdout = _null_stream()
    args.argv = argv
    args.command_line = shlex.join(["tandem", *argv])
    return args.handler(args, args.subparser)


if __name__ == "__main__":
    sys.exit(main())
