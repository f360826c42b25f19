r"""``tandem transcribe``: recordings in, one line of text per recording out, with a trained recognizer.

Prints ``path<TAB>text`` per file in the order of the arguments. As ``sha256sum`` writes names, a path
holding a backslash, a newline or a carriage return (or a tab, the separator here) is escaped, its line
starting with a backslash: ``\\`` for a backslash, ``\n``, ``\r``, ``\t``; a character that standard
output's encoding cannot hold (``PYTHONIOENCODING=latin-1``) is written as Python's escape, ``\u58f0``,
and its path is escaped too. ``--json``: one JSON object per line with ``path``, ``text``,
``audio_seconds`` and ``compute_seconds``, or ``path``, ``text`` null and ``error`` for a file that cannot
be transcribed (in ASCII, ``\uXXXX``, where the output's encoding cannot hold the line). A file that
cannot be transcribed (missing, not audio, empty, silent) gets one line on stderr naming it, the others
are still transcribed, and the exit status is 1. A ``--model`` that is not a recognizer checkpoint stops
everything with exit status 2. ``-`` reads a recording (WAV bytes) from standard input.

Example::

    tandem transcribe --model runs/asr/checkpoint.pt a.wav b.wav
    sox in.mp3 -t wav - | tandem transcribe --json -
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tandem.cli._args import nonempty_path, positive_int
from tandem.cli._output import to_null_device

__all__ = ["DESCRIPTION", "add_arguments", "run"]

DESCRIPTION = (
    "Transcribe recordings (WAV, FLAC, OGG and what else the installed libsndfile reads, MP3 from its "
    "1.1; any rate up to 768 kHz, mono or multi-channel, integer or float samples; - for standard input, "
    "named pipes too) with a recognizer trained by `tandem train`: one line per file, path<TAB>text, in "
    "argument order. A recording with long silence before its first word, after its last or between two "
    "is cut to its words, one that starts on its first word is padded with low noise, and each is "
    "transcribed again (--one-pass: not). Unreadable, empty or silent files are reported on stderr (exit "
    "status 1) while the others are transcribed; a --model that is not a recognizer checkpoint is exit "
    "status 2."
)

PROG = "tandem transcribe"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tandem transcribe``."""
    parser.add_argument("files", nargs="+", metavar="FILE", help="recordings to transcribe; - for stdin")
    parser.add_argument(
        "--model",
        type=nonempty_path,
        default=Path("runs/asr/checkpoint.pt"),
        metavar="CHECKPOINT",
        help="checkpoint written by tandem train (default: runs/asr/checkpoint.pt)",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=16,
        metavar="N",
        help="files per forward pass (default: 16); the transcripts do not depend on it",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda", "auto"),
        default="auto",
        help="where the model runs (default: auto, CUDA when there is one)",
    )
    parser.add_argument(
        "--one-pass",
        action="store_true",
        help="transcribe each recording as it is, in one pass (default: long silence before the first "
        "word, after the last or between two is cut, a recording that starts on its first word is padded, "
        "and each is transcribed again)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="JSON lines: path, text, audio_seconds, compute_seconds (reading, features, model, decoding); "
        "path, text null and error for a file that cannot be transcribed",
    )


class _ClosedStdin:
    """Standard input closed (``<&-``): the file ``-`` fails with its line, as a file that cannot be read."""

    name = "<stdin>"

    def read(self, *args: object) -> bytes:
        raise OSError("standard input is closed")


def _json_line(record: dict[str, object]) -> str:
    """``record`` as a JSON line, its characters as they are where standard output's encoding holds them
    all, else in ASCII (``\\uXXXX``; a name's bytes that were not UTF-8, Python's surrogate escapes, too:
    valid JSON, unlike the raw bytes)."""
    line = json.dumps(record, ensure_ascii=False)
    try:
        line.encode(_encoding())
    except UnicodeEncodeError:
        return json.dumps(record, ensure_ascii=True)
    return line


class _OutputError(Exception):
    """Standard output failed (``> /dev/full``, a full disk), other than a reader that left."""


def _encoding() -> str:
    """Standard output's encoding (UTF-8 for a stream that names none)."""
    return getattr(sys.stdout, "encoding", None) or "utf-8"


def _fits(text: str, encoding: str) -> bool:
    """Whether standard output in ``encoding`` writes ``text`` as it is (a name's bytes that were not UTF-8,
    as surrogate escapes, are written as those bytes)."""
    try:
        text.encode(encoding, "surrogateescape")
    except UnicodeEncodeError:
        return False
    return True


def _writable(text: str, encoding: str) -> str:
    """``text`` with each character ``encoding`` cannot hold as Python's backslash escape (``\\xe9``,
    ``\\u58f0``): a traceback would lose the files after it."""
    if _fits(text, encoding):
        return text
    return "".join(c if _fits(c, encoding) else c.encode("ascii", "backslashreplace").decode() for c in text)


def _emit(line: str) -> None:
    """One line on standard output, flushed, so that each file's line is out as soon as it is known."""
    try:
        print(_writable(line, _encoding()), flush=True)
    except BrokenPipeError:
        raise
    except OSError as e:
        raise _OutputError(e.strerror or str(e)) from e


def _plain_path(path: str) -> str:
    """``path`` as a ``path<TAB>text`` line starts: as it is, or escaped and marked with a leading
    backslash (see the module docstring) when a newline, carriage return or tab in it would break the line,
    a backslash in it would read as an escape, or standard output cannot hold a character of it (written
    as an escape by :func:`_emit`)."""
    if not any(c in path for c in "\\\n\r\t") and _fits(path, _encoding()):
        return path
    escaped = path.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    return "\\" + escaped


def _fail(message: str) -> int:
    print(f"{PROG}: error: {_one_line(message)}", file=sys.stderr)
    return 2


def _one_line(message: str) -> str:
    """``message`` (which names a file) on one line: a newline or carriage return in a name as ``\\n``,
    ``\\r``, so that each error is the one line on stderr the module docstring promises."""
    return message.replace("\r", "\\r").replace("\n", "\\n")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``tandem transcribe`` with parsed ``args``: 0 if every file was transcribed, 1 if some could
    not be (each named on stderr), 2 if nothing could be (the checkpoint, the device, the arguments)."""
    if args.files.count("-") > 1:
        return _fail("- (standard input) can be given once")
    if sys.stdout is None:  # `>&-`: print() would drop every line and the run end in success
        return _fail("standard output is closed: nowhere to write the transcripts")
    try:
        # torch and the recognizer load only here: `tandem --help` stays quick
        from tandem.asr.checkpoint import CheckpointError
        from tandem.asr.recognizer import Recognizer

        try:
            recognizer = Recognizer.from_checkpoint(
                args.model, device=args.device, fit_edges=not args.one_pass
            )
        except CheckpointError as e:
            return _fail(f"--model: {e}")
        except ValueError as e:  # CUDA asked for and absent
            return _fail(f"--device: {e}")
    except KeyboardInterrupt:  # Ctrl-C while torch loads: one line, as later
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130

    # a file name that is not valid UTF-8 reaches Python with surrogates for its odd bytes: printed as the
    # bytes they stand for (as ls prints it), and in JSON as escapes (valid JSON, unlike the raw bytes)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="surrogateescape")
    stdin = sys.stdin.buffer if sys.stdin is not None else _ClosedStdin()
    sources = [stdin if f == "-" else f for f in args.files]
    failed = 0
    try:
        for arg, result in zip(args.files, recognizer.iter_transcribe_files(sources, args.batch_size)):
            if result.error is not None:
                failed += 1
                print(f"{PROG}: error: {_one_line(result.error)}", file=sys.stderr, flush=True)
                if args.json:  # its line too, so that a reader of the JSON lines sees every file
                    _emit(_json_line({"path": arg, "text": None, "error": result.error}))
            elif args.json:
                record = {
                    "path": arg,
                    "text": result.text,
                    "audio_seconds": round(result.audio_seconds, 4),
                    "compute_seconds": round(result.seconds, 4),
                }
                _emit(_json_line(record))
            else:
                _emit(f"{_plain_path(arg)}\t{result.text}")
    except BrokenPipeError:  # `tandem transcribe ... | head`: the reader left; nothing more to say
        to_null_device(sys.stdout)
        return 1
    except _OutputError as e:  # the transcripts are lost: nothing was delivered
        to_null_device(sys.stdout)
        return _fail(f"writing the transcripts to standard output: {e}")
    except KeyboardInterrupt:  # Ctrl-C: what was printed stands; one line, the shell's status for SIGINT
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    return 1 if failed else 0
