"""``tandem train``: a DeepSpeech-style speech recognizer on the bundled spoken digits (the default), or
the Japanese Vowels speaker classifier (``--task classify``), data-parallel.

``--nproc N`` starts N processes through torchrun (``torch.distributed.run``): Gloo on CPUs, NCCL on
GPUs. Inside torchrun (``WORLD_SIZE`` set) this command is the worker itself, so multi-node runs are
``torchrun --nnodes ... -m tandem train ...`` with torchrun's usual options, or ``--nnodes``,
``--node-rank``, ``--master-addr`` and ``--master-port`` here.

Example::

    tandem train --out runs/asr                          # speech recognition, 2 processes
    tandem train --out runs/asr --resume                 # continue a run that was stopped
    tandem train --task classify --out runs/jv           # the Japanese Vowels classifier
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tandem.cli._args import (
    epochs,
    layers,
    nonempty_path,
    port,
    positive_float,
    positive_int,
    seconds,
    seed,
    threads,
    wait_seconds,
    workers,
)
from tandem.cli._output import keep_going_without_output

__all__ = ["DESCRIPTION", "add_arguments", "run", "DEFAULTS"]

DESCRIPTION = (
    "Train a DeepSpeech-style CTC speech recognizer (convolutions, bidirectional GRU/LSTM, SyncBatchNorm, "
    "Adagrad, data parallel) on the bundled spoken digits, or (--task classify) a speaker classifier on "
    "Japanese Vowels or your own --data file; writes metrics.json, a training-curve PNG and a checkpoint "
    "to --out."
)

# Options whose default depends on the task (None on the command line means "the task's default").
DEFAULTS = {
    "asr": {"hidden": 128, "layers": 3, "epochs": 48, "lr": 0.03, "batch_size": 32, "out": Path("runs/asr")},
    "classify": {
        "hidden": 64,
        "layers": 2,
        "epochs": 20,
        "lr": 0.05,
        "batch_size": 32,
        "out": Path("runs/train"),
    },
}

# torchrun's restarts of failed processes where --max-restarts is not given
DEFAULT_MAX_RESTARTS = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tandem train``."""
    parser.add_argument(
        "--task",
        choices=("asr", "classify"),
        default="asr",
        help="asr: speech recognition on the bundled spoken digits (default); classify: Japanese Vowels",
    )
    parser.add_argument(
        "--cell", choices=("gru", "lstm"), default="gru", help="recurrent cell (default: gru)"
    )
    parser.add_argument(
        "--hidden", type=positive_int, help="hidden size per direction (default: asr 128, classify 64)"
    )
    parser.add_argument("--layers", type=layers, help="recurrent layers (default: asr 3, classify 2)")
    parser.add_argument(
        "--epochs",
        type=epochs,
        help="epochs in total (default: asr 48, classify 20; with --resume, the run's own)",
    )
    parser.add_argument(
        "--lr", type=positive_float, help="Adagrad learning rate (default: asr 0.03, classify 0.05)"
    )
    parser.add_argument(
        "--batch-size", type=positive_int, help="global batch, split over processes (default: 32)"
    )
    parser.add_argument("--seed", type=seed, default=0, help="random seed, 0 to 2**32 - 1 (default: 0)")
    parser.add_argument(
        "--out", type=nonempty_path, help="output folder (default: runs/asr, classify runs/train)"
    )
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    asr = parser.add_argument_group("speech recognition (--task asr)")
    asr.add_argument(
        "--test-speaker",
        default=None,
        help="hold this speaker out as the test set and train on the other five (default: the customary "
        "split, takes 0-4 of every speaker)",
    )
    asr.add_argument(
        "--augment",
        choices=("auto", "on", "off"),
        default="auto",
        help="speed, noise and SpecAugment perturbation of the training audio; auto (default): on with "
        "--test-speaker (a voice never heard in training), off on the customary split, where in a "
        "5-minute run it costs more than it gives (BENCHMARKS.md)",
    )
    asr.add_argument(
        "--warmup-steps", type=int, default=50, help="steps of linear learning-rate warm-up (default: 50)"
    )
    asr.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        metavar="K",
        help="also write a checkpoint every K optimizer steps (default 0: every minute of training); one is "
        "always written at each epoch's end and when a signal stops the run",
    )
    asr.add_argument(
        "--keep-checkpoints",
        type=positive_int,
        default=2,
        metavar="N",
        help="numbered checkpoints to keep besides checkpoint.pt, the newest (default: 2)",
    )
    asr.add_argument(
        "--conv-channels", type=positive_int, default=16, help="channels of the convolutions (default: 16)"
    )
    asr.add_argument(
        "--normalize",
        choices=("utterance", "band"),
        default="utterance",
        help="how the log-mel bands are scaled once each band's mean over the utterance is taken away: "
        "utterance (default), by one standard deviation over the utterance's bands and frames; band, each "
        "by its own (tandem's features before this option existed: to resume a run trained on them)",
    )
    asr.add_argument(
        "--train-manifest",
        type=nonempty_path,
        metavar="JSONL",
        help="train on your own recordings: JSON lines {audio_filepath, text, duration} (NeMo's manifests); "
        "needs --test-manifest",
    )
    asr.add_argument("--test-manifest", type=nonempty_path, metavar="JSONL", help="the recordings to test on")
    asr.add_argument(
        "--alphabet",
        default="",
        metavar="CHARS",
        help="characters to add to blank, space, apostrophe and a-z (for example digits or accents)",
    )
    asr.add_argument(
        "--workers",
        type=workers,
        default=None,
        metavar="N",
        help="DataLoader processes per rank that read recordings and compute features ahead of the "
        "steps (default: 2 with manifests, 0 for the bundled digits, whose generator is cheap)",
    )
    classify = parser.add_argument_group("classification (--task classify)")
    classify.add_argument(
        "--data",
        type=nonempty_path,
        default=None,
        help="a .npz with features [N,T,F], lengths [N], labels [N], optional split [N] (see tandem.data)",
    )
    launch = parser.add_argument_group("processes")
    launch.add_argument(
        "--nproc",
        type=positive_int,
        default=None,
        help="data-parallel processes on this machine (default: 2 on CPUs, one per GPU on CUDA)",
    )
    launch.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: auto")
    launch.add_argument("--nnodes", type=positive_int, default=1, help="torchrun: machines (default: 1)")
    launch.add_argument("--node-rank", type=int, default=0, help="torchrun: this machine's rank")
    launch.add_argument(
        "--master-addr",
        default="127.0.0.1",
        help="multi-node: node 0's address (one node's processes meet on a free local port, as torchrun "
        "--standalone's, and need neither this nor --master-port)",
    )
    launch.add_argument("--master-port", type=port, default=29500, help="multi-node: node 0's port")
    launch.add_argument("--timeout", type=seconds, default=60.0, help="collective timeout, s (default: 60)")
    launch.add_argument(
        "--threads",
        type=threads,
        default=None,
        metavar="N",
        help="torch CPU threads per process (default: this machine's cores over its processes)",
    )
    launch.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        metavar="N",
        help=f"torchrun: restart the processes up to N times after one fails; the speech task then "
        f"continues from its newest checkpoint (default: {DEFAULT_MAX_RESTARTS}). One process on one node "
        "(--nproc 1) runs without torchrun, and so without restarts, unless N is given",
    )
    launch.add_argument(
        "--rdzv-timeout",
        type=wait_seconds,
        default=300,
        metavar="S",
        help="multi-node: seconds to wait for every node to join, at the start and after a restart "
        "(default: 300)",
    )


def _fail(parser: argparse.ArgumentParser, message: str) -> int:
    parser.print_usage(sys.stderr)
    print(f"tandem train: error: {message}", file=sys.stderr)
    return 2


def _check_out(out: Path, resume: bool) -> str | None:
    """Why ``out`` cannot take this run's files, or None. Creates the folder, writes nothing else."""
    if out.exists() and not out.is_dir():
        return f"--out {out}: expected a folder, found a file"
    if resume and not out.exists():
        return f"--resume: expected a checkpoint at {out / 'checkpoint.pt'}, found no folder {out}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".tandem-write-test-"):
            pass
    except OSError as e:
        return f"--out {out}: cannot write there ({e.strerror or e})"
    from tandem.asr.checkpoint import CheckpointStore

    store = CheckpointStore(out)
    if resume and not (store.path.exists() or store.numbered()):  # (checkpoint_old.pt is none)
        aside = sorted({p.parent.name for p in out.glob("previous*/checkpoint*.pt")})
        hint = (
            f" (earlier runs were set aside in {', '.join(a + '/' for a in aside)} there: move one's files "
            "back to continue it)"
            if aside
            else ""
        )
        return f"--resume: expected a checkpoint at {out / 'checkpoint.pt'}, found none{hint}"
    return None


# Set for the workers of a launcher that holds --out (see _hold_out).
_OUT_HELD_ENV = "TANDEM_TRAIN_OUT_HELD"


@contextlib.contextmanager
def _hold_out(out: Path, hold: bool) -> Iterator[str | None]:
    """Hold ``out`` for this run (if ``hold``) while the block runs: yields why another run holds it, or
    None.

    Two runs writing one folder would set each other's checkpoints aside or overwrite them, so a run
    takes an exclusive lock on the folder itself (``flock`` on its descriptor: no lock file is left
    behind, and the lock goes with the process that held it, however it ends). Only node rank 0 takes
    it (its launcher, or rank 0 under a torchrun started by hand): the other nodes of the run may share
    the folder. Where the file system cannot lock a folder the run goes on without one.
    """
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        yield None
        return
    if not hold:
        yield None
        return
    try:
        fd = os.open(out, os.O_RDONLY)
    except OSError:  # not there yet (a worker started by hand makes it later)
        yield None
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield (
                f"--out {out}: another tandem train is writing to this folder; wait for it to end or "
                "choose another --out"
            )
            return
        except OSError:  # a file system that cannot lock a folder
            pass
        yield None
    finally:
        os.close(fd)


def _check_resume(args: argparse.Namespace) -> str | None:
    """Why ``--resume`` cannot continue from the checkpoint in ``--out`` exactly, or None (speech task)."""
    if not args.resume or args.task != "asr":
        return None
    from tandem.asr.checkpoint import CheckpointVersionError
    from tandem.asr.training import resume_mismatch

    try:
        state, _, skipped = _latest_checkpoint(args, args.out)
    except CheckpointVersionError as e:
        return f"--resume: {e}"
    if state is None:
        return f"--resume: no readable checkpoint in {args.out} ({'; '.join(skipped)})"
    return resume_mismatch(asr_config(args), args.nproc * args.nnodes, state)


def _with_defaults(args: argparse.Namespace) -> argparse.Namespace:
    for key, value in DEFAULTS[args.task].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def _gpus(device: str) -> int | None:
    """The GPU count where ``--device`` means CUDA (``cuda``, or ``auto`` with a GPU there), else None."""
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return None
    return torch.cuda.device_count()


def _check_nproc(args: argparse.Namespace) -> str | None:
    """Give ``--nproc`` its default (2 on CPUs, one process per GPU on CUDA); why the processes cannot run
    here, or None. On CUDA each process takes the GPU of its local rank (NCCL runs one rank per GPU)."""
    gpus = _gpus(args.device)
    if args.device == "cuda" and gpus is None:
        import torch

        return f"--device cuda: CUDA is not available (torch {torch.__version__})"
    if args.nproc is None:
        args.nproc = gpus or 2
    if gpus is not None and args.nproc > gpus:
        return (
            f"--nproc: expected at most {gpus} on CUDA (one process per GPU; this machine has {gpus}), got "
            f"{args.nproc}; or train on the CPU with --device cpu"
        )
    return None


def _check_manifests(args: argparse.Namespace) -> str | None:
    """Why the manifests cannot be trained on (every line is checked: files, text, alphabet, lengths)."""
    if (args.train_manifest is None) != (args.test_manifest is None):
        return "--train-manifest and --test-manifest: expected both or neither"
    if args.train_manifest is None:
        if args.alphabet:
            return "--alphabet: only with --train-manifest (the bundled digits need no other characters)"
        return None
    if args.test_speaker is not None:
        return "--test-speaker: only for the bundled digits, not with --train-manifest"
    from tandem.asr.manifest import ManifestError
    from tandem.asr.training import checked_manifests

    try:
        key, (train, test) = checked_manifests(asr_config(args))
    except ManifestError as e:
        return str(e)
    args.checked_manifests = (key, (train, test))  # for the ranks (see _launch)
    # every process takes a share of each global batch and of the test set (a process with none would
    # wait for the others' collectives)
    world = args.nproc * args.nnodes
    for what, path, entries in (
        ("--train-manifest", args.train_manifest, train),
        ("--test-manifest", args.test_manifest, test),
    ):
        if len(entries) < world:
            return (
                f"{what} {path}: {len(entries)} recording(s) for {world} processes; expected at least one "
                f"per process (--nproc x --nnodes)"
            )
    _warn_of_shared_recordings(train, test, args.train_manifest, args.test_manifest)
    return None


def _warn_of_shared_recordings(train: list, test: list, train_path: Path, test_path: Path) -> None:
    """A warning on stderr where test recordings (the same file and part of it) are training recordings
    too: their WER says how well the model learned them, not how it hears what it never heard."""
    from tandem.asr.distributed import torchrun_int

    if torchrun_int("RANK", 0) or torchrun_int("TORCHELASTIC_RESTART_COUNT", 0):
        return  # once: every rank of a torchrun started by hand checks the manifests, at every restart
    # by file name first, then by real path (system calls: 6 s for LibriSpeech's 281k lines) only where
    # the names agree (so a link under another name than its file's is not seen as the file)
    tested = {(e.path.name, e.start, e.frames) for e in test}
    trained = {
        (os.path.realpath(e.path), e.start, e.frames): e.line
        for e in train
        if (e.path.name, e.start, e.frames) in tested
    }
    shared = [
        (e.line, trained[k]) for e in test if (k := (os.path.realpath(e.path), e.start, e.frames)) in trained
    ]
    if shared:
        line, train_line = shared[0]
        print(
            f"tandem train: warning: {len(shared)} of the {len(test)} test recordings are training "
            f"recordings too (the first: {test_path} line {line}, {train_path} line {train_line}); the test "
            "WER will not say how the model hears recordings it never trained on",
            file=sys.stderr,
            flush=True,
        )


def _check_master_addr(args: argparse.Namespace) -> str | None:
    """Why the nodes could not meet at --master-addr, or None: a name that does not resolve (a typo) had
    torchrun retry for a minute and end in a traceback. One node needs no address (a standalone launch)."""
    if args.nnodes == 1:
        return None
    try:
        socket.getaddrinfo(args.master_addr, args.master_port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:  # socket.gaierror is an OSError; an empty label a UnicodeError
        reason = getattr(e, "strerror", None) or str(e)
        return (
            f"--master-addr: expected a host name or address of node 0, got {args.master_addr!r} ({reason})"
        )
    return None


def _check_task_options(args: argparse.Namespace) -> str | None:
    """Why the options do not fit the task, or None (checked before anything is written)."""
    if args.max_restarts is not None and args.max_restarts < 0:
        return f"--max-restarts: expected a number >= 0, got {args.max_restarts}"
    world = args.nproc * args.nnodes
    if args.batch_size < world:
        return (
            f"--batch-size: expected at least one utterance per process ({world}: --nproc x --nnodes), "
            f"got {args.batch_size}"
        )
    if args.task == "asr":
        if args.data is not None:
            return "--data: only for --task classify (speech recognition trains on the bundled recordings)"
        if args.test_speaker is not None:
            from tandem.asr.corpus import load_spoken_digits

            speakers = load_spoken_digits().speakers
            if args.test_speaker not in speakers:
                return f"--test-speaker: expected one of {', '.join(speakers)}, got {args.test_speaker!r}"
        if args.warmup_steps < 0:
            return f"--warmup-steps: expected a number >= 0, got {args.warmup_steps}"
        if args.checkpoint_every < 0:
            return f"--checkpoint-every: expected a number of steps >= 0, got {args.checkpoint_every}"
        return _check_alphabet(args.alphabet) or _check_asr_model_size(args) or _check_manifests(args)
    if args.train_manifest or args.test_manifest or args.alphabet:
        return "--train-manifest, --test-manifest and --alphabet: only for --task asr"
    from tandem.data import JAPANESE_VOWELS, load_npz

    if args.test_speaker is not None:
        return "--test-speaker: only for --task asr"
    # the classifier reads none of the other speech options: a value given for one would be ignored
    defaults = {a.dest: a.default for a in _train_parser_actions()}
    given = [f"--{k.replace('_', '-')}" for k in _ASR_ONLY if getattr(args, k) != defaults[k]]
    if given:
        return f"{', '.join(given)}: only for --task asr"
    try:
        data = load_npz(args.data or JAPANESE_VOWELS)
    except ValueError as e:
        return str(e)
    for what, count in (("train", int((~data.is_test).sum())), ("test", int(data.is_test.sum()))):
        if count < world:  # a process with none would wait for the others' collectives
            return (
                f"--data {args.data or JAPANESE_VOWELS}: {count} {what} sequence(s) for {world} processes; "
                "expected at least one per process (--nproc x --nnodes)"
            )
    from tandem.models import SpeechClassifier

    return _check_model_size(
        args,
        lambda: SpeechClassifier(data.num_features, data.num_classes, args.hidden, args.layers, args.cell),
        f"--hidden {args.hidden}, --layers {args.layers}",
        "the classifier",
    )


# Speech options besides those checked by name above (manifests, --alphabet, --test-speaker)
_ASR_ONLY = (
    "augment",
    "warmup_steps",
    "checkpoint_every",
    "keep_checkpoints",
    "conv_channels",
    "normalize",
    "workers",
)


def _check_asr_model_size(args: argparse.Namespace) -> str | None:
    """:func:`_check_model_size` of the recognizer."""
    from tandem.asr.model import DeepSpeech2

    sizes = f"--hidden {args.hidden}, --layers {args.layers}, --conv-channels {args.conv_channels}"
    return _check_model_size(args, lambda: DeepSpeech2(asr_config(args).model), sizes)


def _check_model_size(
    args: argparse.Namespace, build: Callable[[], Any], sizes: str, what: str = "a model"
) -> str | None:
    """Why the model ``build`` makes cannot fit in this machine's memory, or None. Counted on the meta
    device (nothing allocated): its weights, their gradients and Adagrad's state, three float32 copies per
    process (a lower bound: activations left out), for this node's processes, against the memory available
    now (Linux's MemAvailable; one GPU's memory per process on CUDA). A typo such as --hidden 100000000
    ended in an allocation traceback after the launch; ``sizes`` names the options that set it."""
    import torch

    try:
        with torch.device("meta"):
            count = sum(p.numel() for p in build().parameters())
    except (RuntimeError, ValueError, OverflowError, TypeError):  # a size past int64 (TypeError: past 2**62)
        return f"{sizes}: {what} too large to count (its sizes overflow)"
    need = 3 * 4 * count
    if _gpus(args.device):
        per, have, where = 1, torch.cuda.get_device_properties(0).total_memory, "one GPU has"
    else:
        from tandem.asr.distributed import torchrun_int

        per = torchrun_int("LOCAL_WORLD_SIZE", args.nproc)  # this node's processes
        have, where = _memory_available(), "this machine has"
    if have is None or per * need <= have:
        return None
    return (
        f"{sizes}: {what} of {count:.3g} parameters needs at least {need / 2**30:.3g} GiB per process "
        f"(weights, gradients and Adagrad's state in float32), {per * need / 2**30:.3g} GiB for "
        f"{per} process(es); {where} {have / 2**30:.3g} GiB available"
    )


def _memory_available() -> int | None:
    """Bytes of memory available for new processes (Linux's MemAvailable), or None where not known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _check_alphabet(extra: str) -> str | None:
    """Why ``--alphabet`` cannot add these characters: the blank's sign, whitespace or upper case
    (transcripts are lower-cased and their whitespace runs made one space, so neither could be a label)."""
    from tandem.asr.text import BLANK

    if BLANK in extra:
        return f"--alphabet: {BLANK!r} stands for the CTC blank and cannot be a character, got {extra!r}"
    spaces = "".join(dict.fromkeys(c for c in extra if c.isspace() and c != " "))
    if spaces:
        return (
            f"--alphabet: whitespace in transcripts becomes one space (' ', already a character), so "
            f"{spaces!r} can never occur, got {extra!r}"
        )
    upper = "".join(dict.fromkeys(c for c in extra if c != c.lower()))
    if upper:
        return (
            f"--alphabet: transcripts are lower-cased, so {upper!r} can never occur; give "
            f"{upper.lower()!r}, got {extra!r}"
        )
    return None


def asr_config(args: argparse.Namespace):
    """The :class:`tandem.asr.training.TrainConfig` of ``tandem train --task asr`` options."""
    from tandem.asr.features import FeatureConfig
    from tandem.asr.model import ModelConfig
    from tandem.asr.text import ENGLISH, Alphabet
    from tandem.asr.training import TrainConfig

    alphabet = Alphabet.widened(ENGLISH, [args.alphabet]) if args.alphabet else ENGLISH
    # absolute as named, links kept: a line's relative path is relative to the folder the user named (a
    # link's, as NeMo reads it), not to the folder of the file a link points to
    manifests = {
        f"{which}_manifest": os.path.abspath(path) if path else None
        for which, path in (("train", args.train_manifest), ("test", args.test_manifest))
    }
    return TrainConfig(
        model=ModelConfig(
            n_classes=len(alphabet),
            cell=args.cell,
            hidden=args.hidden,
            layers=args.layers,
            conv_channels=args.conv_channels,
        ),
        features=FeatureConfig(normalize=args.normalize),
        alphabet=alphabet.characters,
        **manifests,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        seed=args.seed,
        test_speaker=args.test_speaker,
        augment=args.augment == "on" or (args.augment == "auto" and args.test_speaker is not None),
    )


def _work(args: argparse.Namespace) -> int:
    """Train in this process (one rank of torchrun's group, or the only process)."""
    if args.task == "asr":
        from tandem.asr.training import Checkpointing, train

        return train(
            asr_config(args),
            args.out,
            resume=args.resume,
            device=args.device,
            timeout=args.timeout,
            checkpointing=Checkpointing(every=args.checkpoint_every, keep=args.keep_checkpoints),
            threads=args.threads,
            workers=args.workers if args.workers is not None else 2 * (args.train_manifest is not None),
        )
    from tandem.cli._train_worker import train

    return train(args)


# Options only the launcher reads; the workers learn their world from torchrun's environment.
_LAUNCHER_OPTIONS = (
    "nproc",
    "nnodes",
    "node_rank",
    "master_addr",
    "master_port",
    "max_restarts",
    "rdzv_timeout",
)


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
    planned = _planned_epochs(args) if args.resume and args.epochs is None else None
    args = _with_defaults(args)
    if planned is not None:
        args.epochs = planned
    # `tandem train | head`, `2>&1 | head`, a log on a full disk: the run goes on and writes its files (the
    # launcher too: its Ctrl-C handler writes to stderr before it passes the stop on to the ranks)
    keep_going_without_output(
        f"tandem train: standard output failed; the run goes on without printing there and writes its "
        f"results to {args.out}"
    )
    if "WORLD_SIZE" in os.environ:  # a torchrun worker
        problem = _check_torchrun_environment()
        if problem:
            return _fail(parser, problem)
        if _OUT_HELD_ENV not in os.environ:
            # started by torchrun directly, not by our launcher, which checked the options and holds
            # --out: every rank checks them (the same verdict), rank 0 says it, and rank 0 holds --out
            problem = _check_worker_options(args)
            if problem:
                return _fail(parser, problem) if os.environ.get("RANK") == "0" else 2
        holds = os.environ.get("RANK") == "0" and _OUT_HELD_ENV not in os.environ
        with _hold_out(args.out, holds) as held:
            return _fail(parser, held) if held else _work(args)

    # Everything a run could trip on is checked before anything is written or launched.
    try:
        problem = _in_thread(lambda: _check_nproc(args) or _check_task_options(args))
    except KeyboardInterrupt:  # Ctrl-C while a long manifest is checked: nothing written yet
        print("tandem train: interrupted while checking the arguments; nothing was written", file=sys.stderr)
        # at once: the interpreter's shutdown beside the check's thread, inside libsndfile, can abort
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    if problem:
        return _fail(parser, problem)
    if not 0 <= args.node_rank < args.nnodes:
        return _fail(parser, f"--node-rank: expected a value in [0, {args.nnodes - 1}], got {args.node_rank}")
    problem = _check_master_addr(args) or _check_out(args.out, args.resume)
    if problem:
        return _fail(parser, problem)
    with _hold_out(args.out, args.node_rank == 0) as held:
        problem = held or _check_resume(args)
        if problem:
            return _fail(parser, problem)
        if not args.resume and args.node_rank == 0:
            # here, where torchrun's restarts never come back: rank 0 did it, and a rank 0 that died
            # before it had (killed, out of memory) came back as a restart, which takes the folder's
            # checkpoints for this launch's: the earlier run was trained on, or overwritten
            from tandem.asr.checkpoint import CheckpointStore

            CheckpointStore(args.out).set_aside_and_say()
        return _train_or_launch(args)


def _planned_epochs(args: argparse.Namespace) -> int | None:
    """The epochs the run in --out was started with, which --resume without --epochs trains to (the task's
    default extended a 2-epoch run to 48, its learning-rate schedule with it), or None where no
    checkpoint says (one unreadable is refused later, by the checks of a resume)."""
    from tandem.asr.checkpoint import CheckpointError, read_checkpoint_file

    out = args.out if args.out is not None else DEFAULTS[args.task]["out"]
    try:
        if args.task == "asr":
            state = _latest_checkpoint(args, out)[0] or {}  # (another version's: refused later)
            epochs = state.get("train_config", {}).get("epochs")
        else:
            epochs = read_checkpoint_file(Path(out) / "checkpoint.pt").get("epochs")
    except (CheckpointError, AttributeError, OSError):
        return None
    return epochs if isinstance(epochs, int) and epochs > 0 else None


def _latest_checkpoint(args: argparse.Namespace, out: Path) -> tuple:
    """``CheckpointStore(out).latest()`` without the weights (the settings and where the run is, what the
    launcher's checks read), read once for a launch: a resume's epochs, then its check, each read a whole
    checkpoint. The folder does not change between them (a run writing there is refused)."""
    from tandem.asr.checkpoint import CheckpointStore

    cached = getattr(args, "latest_checkpoint", None)
    if cached is None or cached[0] != Path(out):
        state, path, skipped = CheckpointStore(out).latest()
        if state is not None:  # (not kept in memory through the run)
            state = {k: v for k, v in state.items() if k not in ("model", "optimizer", "rng")}
        cached = args.latest_checkpoint = (Path(out), (state, path, skipped))
    return cached[1]


def _in_thread(compute: Callable[[], object]) -> object:
    """``compute()`` in a thread of its own while this (main) thread waits for it, so that a Ctrl-C lands
    here and not inside it: the manifests' check reads files through soundfile's C callbacks, which took
    in a KeyboardInterrupt and blamed a good file, lost the signal (the run trained on), or once crashed
    (a double free)."""
    from tandem.asr.interrupt import Background

    work = Background(compute, "tandem-check")
    while not work.done:
        work.wait(0.1)
    return work.result()


def _check_torchrun_environment() -> str | None:
    """What is wrong with the variables torchrun sets for its workers, or None: WORLD_SIZE is set (this
    process runs as a worker), so the others must be too, as numbers that fit it (one left over from a
    job script, or mistyped, ended in a traceback deep in the process group's start)."""
    world = os.environ["WORLD_SIZE"]
    if not world.isdigit() or int(world) < 1:
        return (
            f"environment variable WORLD_SIZE: expected a positive integer (torchrun sets it), got {world!r}"
        )
    if "RANK" not in os.environ:
        return (
            f"environment variable RANK: not set, where WORLD_SIZE is ({world}); start workers with torchrun"
        )
    # (LOCAL_RANK and LOCAL_WORLD_SIZE default to 0 and 1)
    for name, low, high in (("RANK", 0, int(world) - 1), ("LOCAL_RANK", 0, int(world) - 1),
                            ("LOCAL_WORLD_SIZE", 1, int(world))):  # fmt: skip
        value = os.environ.get(name)
        if value is not None and not (value.isdigit() and low <= int(value) <= high):
            return (
                f"environment variable {name}: expected an integer from {low} to {high} (WORLD_SIZE "
                f"{world}), got {value!r}"
            )
    return None


def _check_worker_options(args: argparse.Namespace) -> str | None:
    """What :func:`run` checks before launching, for a worker of a torchrun started by hand: its world is
    torchrun's, and the launcher's options are torchrun's own."""
    if args.device == "cuda" and _gpus("cuda") is None:
        return _check_nproc(args)  # its message
    args.nproc, args.nnodes = int(os.environ["WORLD_SIZE"]), 1  # the world, as the checks count it
    return _check_task_options(args) or _check_out(args.out, args.resume)


def _train_or_launch(args: argparse.Namespace) -> int:
    """Train in this process (one process in all, no restarts asked for), or launch torchrun."""
    if args.nproc == 1 and args.nnodes == 1 and args.max_restarts is None:
        if args.task != "asr":
            return _classify_here(args)
        code = _work(args)
        if code == 130:  # stopped by a signal, after a checkpoint
            print(f"tandem train: stopped; to continue: {_resume_command(args)}", file=sys.stderr, flush=True)
        return code
    return _launch(args)


def _classify_here(args: argparse.Namespace) -> int:
    """The classifier in this one process. Its loop takes no stop request: a SIGINT or SIGTERM ends it at once
    (the checkpoint of its last finished epoch stays), with one line and status 130, as the launcher ends
    its ranks (a KeyboardInterrupt traceback for Ctrl-C; SIGTERM's death, status 143, without a word)."""
    received: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        received.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_signal)
    try:
        return _work(args)
    except KeyboardInterrupt:
        name = signal.Signals(received[0]).name if received else "SIGINT"
        print(f"tandem train: {name}: stopping at once", file=sys.stderr, flush=True)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def _torchrun_command(args: argparse.Namespace) -> list[str]:
    """torchrun's command line: elastic restarts, and a c10d rendezvous across nodes (node rank 0 hosts its
    store at --master-addr:--master-port; the others join within --rdzv-timeout)."""
    if args.nnodes == 1:
        rendezvous = ["--standalone"]
    else:
        rendezvous = [
            f"--nnodes={args.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={args.master_addr}:{args.master_port}",
            "--rdzv-id=tandem-train",
            f"--rdzv-conf=join_timeout={args.rdzv_timeout},is_host={int(args.node_rank == 0)}",
        ]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *rendezvous,
        f"--nproc-per-node={args.nproc}",
        f"--max-restarts={DEFAULT_MAX_RESTARTS if args.max_restarts is None else args.max_restarts}",
        "-m",
        "tandem",
        "train",
        *_worker_argv(args),
    ]


class _LaunchSignals:
    """The launcher's SIGINT/SIGTERM handler: the first signal goes on to torchrun's children (the workers
    stop after their step, with a checkpoint), a second kills them and torchrun at once (so does the first
    where ``after_step`` is False); the same SIGTERM again within ``StopRequests.SAME_REQUEST_S`` is the
    first one delivered twice (systemd, Slurm and `timeout` send it to the process group and forward it
    too), as the workers take it. Ctrl-C twice is a person's second request."""

    def __init__(self, proc: subprocess.Popen | None, after_step: bool = True) -> None:
        from tandem.asr.interrupt import StopRequests

        self.proc = proc  # None until torchrun has started (:meth:`started`)
        # False (the classifier, whose ranks die of the signal): the first signal ends everything at once;
        # passed on alone, torchrun restarted the dead ranks and the run trained to its end
        self.after_step = after_step
        self.received: list[int] = []
        self._first = 0.0
        self._same_within = StopRequests.SAME_REQUEST_S
        # a first signal, passed on to every rank torchrun starts from then on (:meth:`pass_on_pending`): one
        # that came before this node's ranks existed was lost, and so was one that came as a rank died
        # (torchrun restarted the ranks, which never heard it): the run trained to its end, exit status 0
        self.pending: int | None = None
        self._signalled: set[int] = set()

    def __call__(self, signum: int, frame: object) -> None:
        if (
            self.received
            and signum == self.received[0] == signal.SIGTERM
            and time.monotonic() - self._first < self._same_within
        ):
            return
        self.received.append(signum)
        if len(self.received) > 1 or not self.after_step:
            if len(self.received) == 1:
                name = signal.Signals(signum).name
                print(f"tandem train: {name}: stopping at once", file=sys.stderr, flush=True)
            if self.proc is not None:  # (else as it starts: :meth:`started`)
                self._to_ranks(signal.SIGKILL)  # they die with torchrun only once they have asked to
                self.proc.kill()
            return
        self._first = time.monotonic()
        print(
            f"tandem train: {signal.Signals(signum).name}: stopping after the current step (again to stop "
            "at once)",
            file=sys.stderr,
            flush=True,
        )
        self.pending = signum
        self.pass_on_pending()

    def started(self, proc: subprocess.Popen) -> None:
        """torchrun is ``proc``: what came while it was being started is done now (killed at once, or the
        first signal passed on to its ranks as they appear)."""
        self.proc = proc
        if len(self.received) > 1 or (self.received and not self.after_step):
            proc.kill()
        else:
            self.pass_on_pending()

    def pass_on_pending(self) -> None:
        """Send a first signal to the ranks torchrun has started since it came and that do not have it (a
        rank that is still importing holds it, and stops after its first step): those it started before
        the signal, and those it starts after, when a rank died and it restarts them all."""
        if self.pending is None or len(self.received) != 1 or self.proc is None:
            return
        self._signalled.update(self._to_ranks(self.pending, skip=self._signalled))

    def _to_ranks(self, signum: int, skip: set[int] | None = None) -> list[int]:
        """Send ``signum`` to torchrun's children, this node's ranks, but those in ``skip``; returns the
        pids it went to."""
        sent = [pid for pid in _children(self.proc.pid) if not skip or pid not in skip]
        for pid in sent:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        return sent


def _launch(args: argparse.Namespace) -> int:
    """Run torchrun until it ends. A first SIGINT or SIGTERM goes on to this node's workers, which stop
    after their current step (the ranks on other nodes with them: they agree after every step), write a
    checkpoint and end normally, so torchrun neither restarts them nor reports a failure; a second signal
    ends everything at once (the workers and torchrun; the classifier's at the first), except the same SIGTERM
    again within :attr:`StopRequests.SAME_REQUEST_S` (one signal to the process group, delivered twice)."""
    from tandem.asr.interrupt import (
        EXIT_FILE_ENV,
        LAUNCHER_PID_ENV,
        die_with_parent,
        start_holding_stop_signals,
    )

    # the ranks' verdict that no restart can change (see tandem.asr.training.train): its exit status
    folder = tempfile.TemporaryDirectory(prefix="tandem-train-")
    exit_file = Path(folder.name) / "exit-status"
    env = dict(
        os.environ,
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        **{EXIT_FILE_ENV: str(exit_file), _OUT_HELD_ENV: "1", LAUNCHER_PID_ENV: str(os.getpid())},
    )
    from tandem.asr.training import LAUNCHED_AT_ENV

    env[LAUNCHED_AT_ENV] = repr(time.time())
    if getattr(args, "checked_manifests", None) is not None:
        # rank 0 takes the entries checked here instead of reading every recording's header again (at
        # every launch and restart), where the manifests have not changed since
        from tandem.asr.training import CHECKED_MANIFESTS_ENV, save_checked_manifests

        checked = Path(folder.name) / "manifests.pickle"
        if save_checked_manifests(*args.checked_manifests, checked):
            env[CHECKED_MANIFESTS_ENV] = str(checked)
    on_signal = _LaunchSignals(None, after_step=args.task == "asr")
    received = on_signal.received
    # before torchrun starts: a Ctrl-C while it was being started was a traceback, or (in the fork's
    # hooks, where Python ignores the exception) lost, and the run trained to its end
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        # a session of its own: a Ctrl-C in the terminal reaches this launcher only, which passes it on once
        proc = subprocess.Popen(
            _torchrun_command(args),
            env=env,
            start_new_session=True,
            # the speech task's ranks take a stop request after a step (torchrun leaves it to them); the
            # classifier's die of the signal, as Python's processes do, which torchrun must hear itself
            preexec_fn=functools.partial(
                start_holding_stop_signals if args.task == "asr" else die_with_parent, os.getpid()
            ),
        )
        on_signal.started(proc)
        while True:
            try:
                code = proc.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                on_signal.pass_on_pending()
        said = code == 0 and exit_file.exists()  # the ranks ended the run and said why (stderr)
        if said:
            text = exit_file.read_text().strip()
            code = int(text) if text.isdigit() else 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        folder.cleanup()
    # the ranks' own ending wins over a signal that came with it: a run that finished (0), or that ended for
    # what a --resume would meet again (a recording it cannot read: 2), is no stop to continue from
    ended = code == 0 or (said and code != 130)
    if not ended and (received or code == 130):  # 130: the ranks stopped for a signal that reached one
        if args.task == "asr" and any(args.out.glob("checkpoint*.pt")):
            print(
                f"tandem train: stopped; to continue: {_resume_command(args)}",
                file=sys.stderr,
                flush=True,
            )
        if received:  # one request: the ranks stopped after a step, with a checkpoint: 130 (EXIT_STOPPED), as
            # for Ctrl-C so for SIGTERM, as a single process ends; a second ended everything at once
            return 130 if len(received) == 1 else 128 + received[-1]
        return code
    if code != 0 and not said:
        where = (
            f" (with {args.nnodes} nodes: a node that failed or never joined ends the run within "
            f"--rdzv-timeout, {args.rdzv_timeout} s)"
            if args.nnodes > 1
            else ""
        )
        print(
            f"tandem train: error: the training processes failed, torchrun exit status {code}{where}; "
            "see the report above",
            file=sys.stderr,
            flush=True,
        )
    return code


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux's /proc; none elsewhere)."""
    from tandem.asr.interrupt import parent_of

    others = (int(entry.name) for entry in Path("/proc").glob("[0-9]*"))
    return [other for other in others if parent_of(other) == pid]


def _resume_command(args: argparse.Namespace) -> str:
    """The command line of this run with --resume (``args.argv`` starts with the subcommand)."""
    argv = [a for a in getattr(args, "argv", ["train"]) if a != "--resume"]
    return shlex.join(["tandem", *argv, "--resume"])
