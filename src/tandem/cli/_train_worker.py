"""The training loop of ``tandem train``: one process of the data-parallel group (or the only one).

Data order depends only on (seed, epoch), every rank takes its share of each global batch, and the
gradients are averaged by tandem's DistributedDataParallel: N processes compute what one process
would on the concatenated batch. A resumed run therefore ends with the same weights as an
uninterrupted one (same seed, same number of processes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import tandem
from tandem.asr.checkpoint import (
    CheckpointError,
    CheckpointStore,
    atomic_write,
    not_written,
    read_checkpoint_file,
    write_run_files,
)
from tandem.asr.distributed import Group, pick_device, pin_to_cores, rank_threads
from tandem.asr.interrupt import collective_exit, die_with_torchrun
from tandem.data import JAPANESE_VOWELS, SequenceData, load_npz
from tandem.models import SpeechClassifier

__all__ = ["train"]

# what a checkpoint must agree on to be resumed with the current arguments
_RUN_KEYS = ("cell", "hidden", "layers", "lr", "batch_size", "seed", "world_size", "data")
# how a resume names them: by the options that set them
_OPTION_OF = {k: f"--{k.replace('_', '-')}" for k in _RUN_KEYS} | {
    "world_size": "processes (--nproc x --nnodes)"
}


def _plot(history: list[dict[str, float]], path: Path) -> bool:
    """The loss and accuracy curves as a PNG; False (and a note) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("tandem train: matplotlib is not installed, no training-curve PNG (pip install tandem[plot])")
        return False
    epochs = [h["epoch"] for h in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(epochs, [h["train_loss"] for h in history], marker="o")
    ax_loss.set(xlabel="epoch", ylabel="cross-entropy", title="training loss", yscale="log")
    ax_acc.plot(epochs, [h["train_accuracy"] for h in history], marker="o", label="train")
    ax_acc.plot(epochs, [h["test_accuracy"] for h in history], marker="s", label="test")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="accuracy", ylim=(0, 1.01))
    ax_acc.legend()
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    fig.tight_layout()
    atomic_write(lambda tmp: fig.savefig(tmp, format="png", dpi=110), path)
    plt.close(fig)
    return True


# what a checkpoint of this task holds (see the end of _train)
_CHECKPOINT_KEYS = ("config", "model", "optimizer", "epoch", "history", "train_seconds")


def _read_checkpoint(path: Path, device: torch.device) -> dict[str, Any]:
    """This task's checkpoint at ``path``, checked as the speech task's are (a file damaged in place, or
    cut short, is refused; see :func:`read_checkpoint_file`), or :class:`CheckpointError`."""
    checkpoint = read_checkpoint_file(path, device)
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("config"), dict):
        raise CheckpointError(f"{path}: not a checkpoint of tandem train --task classify")
    missing = [k for k in _CHECKPOINT_KEYS if k not in checkpoint]
    if missing:
        raise CheckpointError(f"{path}: incomplete checkpoint, missing {missing}")
    return checkpoint


def _evaluate(model, data: SequenceData, group: Group, device: torch.device, batch: int) -> tuple[float, int]:
    """(correct, count) of this rank's share of ``data``, summed over ranks."""
    model.eval()
    mine = torch.arange(group.rank, len(data), group.world)
    correct = 0
    with torch.no_grad():
        for i in range(0, len(mine), batch):
            idx = mine[i : i + batch]
            logits = model(data.features[idx].to(device), data.lengths[idx])
            correct += int((logits.argmax(1).cpu() == data.labels[idx]).sum())
    total_correct, total = group.sum([correct, len(mine)])
    return total_correct, int(total)


def train(args: argparse.Namespace) -> int:
    """Train this rank's part; returns the exit status: 0 done, 1 a loss that became NaN or inf or a file
    that could not be written (a full disk), 2 a checkpoint whose settings differ from --resume's (every
    rank reaches these together; under tandem train's launcher they go to its exit-status file instead,
    see tandem.asr.interrupt.collective_exit)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_torchrun()  # the ranks of a launcher killed outright trained on, its --out unlocked
    device = pick_device(args.device)
    # one core per process when the processes share a machine, each on cores of its own (as the speech
    # task's ranks), before the process group starts its threads
    threads = rank_threads(args.threads)
    if device.type == "cpu":
        pin_to_cores(threads)
    group = Group(device, args.timeout)
    try:
        code = _train(args, device, group, threads)
    finally:
        group.close()
    code = collective_exit(code)
    group.leave(code)
    return code


def _error(lead: bool, message: str) -> None:
    if lead:
        print(f"tandem train: error: {message}", file=sys.stderr, flush=True)


def _train(args: argparse.Namespace, device: torch.device, group: Group, threads: int) -> int:
    torch.set_num_threads(threads)
    lead = group.rank == 0
    data_path = args.data or JAPANESE_VOWELS
    data = load_npz(data_path)
    train_set, test_set = data.subset(test=False), data.subset(test=True)
    run_config = {
        "cell": args.cell,
        "hidden": args.hidden,
        "layers": args.layers,
        "lr": args.lr,
        "batch_size": args.batch_size,
        "seed": args.seed,
        "world_size": group.world,
        "data": str(Path(data_path).resolve()),
    }

    torch.manual_seed(args.seed)
    model = SpeechClassifier(data.num_features, data.num_classes, args.hidden, args.layers, args.cell).to(
        device
    )
    wrapped = tandem.parallel.DistributedDataParallel(model) if group.world > 1 else model
    optimizer = tandem.optim.Adagrad(wrapped.parameters(), lr=args.lr)

    checkpoint_path, history, start_epoch, seconds_before = args.out / "checkpoint.pt", [], 0, 0.0
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if lead:  # what a process killed mid-write left, as tandem train's speech task removes it
        CheckpointStore(args.out).remove_leftovers()
    if lead and not args.resume and not restarted:
        # an earlier run's files (this task's, or a speech recognizer's) go aside, as tandem train's do
        CheckpointStore(args.out).set_aside_and_say()
    if args.resume:
        try:  # any unreadable file: one line, exit 2, no torchrun restarts into it
            checkpoint = _read_checkpoint(checkpoint_path, device)
        except CheckpointError as e:
            _error(lead, f"--resume: {e}")
            return 2
        changed = {
            k: (checkpoint["config"].get(k), v)
            for k, v in run_config.items()
            if checkpoint["config"].get(k) != v
        }
        if changed:
            detail = "; ".join(
                f"{_OPTION_OF[k]}: checkpoint {a!r}, now {b!r}" for k, (a, b) in changed.items()
            )
            _error(lead, f"--resume: the run's settings differ from the checkpoint's ({detail})")
            return 2
        trained = checkpoint["epoch"]
        if args.epochs < trained:  # it would end with files of two moments (the speech task refuses it too)
            _error(
                lead,
                f"--epochs {args.epochs}: the checkpoint has trained {trained} epochs; resume with --epochs "
                f"{trained} or more",
            )
            return 2
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        history, start_epoch = checkpoint["history"], checkpoint["epoch"]
        seconds_before = checkpoint["train_seconds"]

    if lead:
        print(
            f"tandem train: {args.cell.upper()} {args.layers}x{args.hidden} bidirectional, {data_path.name}: "
            f"{len(train_set)} train / {len(test_set)} test sequences, {data.num_classes} classes; "
            f"{group.world} process(es) on {device}, global batch {args.batch_size}, Adagrad lr {args.lr}"
            + (f"; resuming after epoch {start_epoch}" if start_epoch else ""),
            flush=True,
        )
    progress = None
    if lead:
        from tqdm import tqdm

        progress = tqdm

    started = time.perf_counter()
    for epoch in range(start_epoch, args.epochs):
        epoch_start = time.perf_counter()
        wrapped.train()
        order = torch.randperm(
            len(train_set), generator=torch.Generator().manual_seed(args.seed * 100003 + epoch)
        )
        batches = [order[i : i + args.batch_size] for i in range(0, len(order), args.batch_size)]
        batches = [b for b in batches if len(b) >= group.world]  # every rank gets at least one sequence
        bar = (
            progress(batches, desc=f"epoch {epoch + 1}/{args.epochs}", unit="batch", leave=False)
            if progress
            else batches
        )
        loss_sum = correct = seen = 0.0
        for global_batch in bar:
            idx = global_batch[group.rank :: group.world]
            features, labels = train_set.features[idx].to(device), train_set.labels[idx].to(device)
            logits = wrapped(features, train_set.lengths[idx])
            loss = F.cross_entropy(logits, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += loss.item() * len(idx)
            correct += int((logits.argmax(1) == labels).sum())
            seen += len(idx)
            if progress:
                rate = seen * group.world / (time.perf_counter() - epoch_start)
                bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{correct / seen:.3f}", seq_s=f"{rate:.0f}")
        loss_sum, correct, seen = group.sum([loss_sum, correct, seen])
        test_correct, test_total = _evaluate(wrapped, test_set, group, device, 256)
        epoch_seconds = time.perf_counter() - epoch_start
        record = {
            "epoch": epoch + 1,
            "train_loss": loss_sum / seen,
            "train_accuracy": correct / seen,
            "test_accuracy": test_correct / test_total,
            "seconds": epoch_seconds,
            "sequences_per_second": seen / epoch_seconds,
        }
        history.append(record)
        problem = None  # why rank 0 could not write this epoch's checkpoint
        if not math.isfinite(record["train_loss"]):  # the same sum on every rank: all stop here
            _error(lead, f"the loss became {record['train_loss']} in epoch {epoch + 1}")
            return 1
        if lead:
            print(
                f"epoch {epoch + 1}/{args.epochs}: loss {record['train_loss']:.4f}, train acc "
                f"{record['train_accuracy']:.4f}, test acc {record['test_accuracy']:.4f}, "
                f"{epoch_seconds:.1f} s",
                flush=True,
            )
            state: dict[str, Any] = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "epoch": epoch + 1,
                "epochs": args.epochs,  # the run's plan, which --resume without --epochs keeps
                "history": history,
                "config": run_config,
                "train_seconds": seconds_before + time.perf_counter() - started,
            }
            try:
                atomic_write(lambda tmp, state=state: torch.save(state, tmp), checkpoint_path)
            except (OSError, RuntimeError) as e:  # torch.save's failed write is a RuntimeError
                problem = not_written(checkpoint_path, e)
        # every rank learns rank 0's outcome and ends with it (an exception would have torchrun restart
        # the group into the same full disk, training from the start)
        if group.sum([float(problem is not None)])[0]:
            found = lead and checkpoint_path.exists()
            _error(
                lead,
                f"the checkpoint after epoch {epoch + 1}: {problem}. "
                + (f"{checkpoint_path} is the one before: " if found else "")
                + "make room, then run the same command"
                + (" with --resume" if found else ""),
            )
            return 1

    if lead:
        train_seconds = seconds_before + time.perf_counter() - started
        final = history[-1] if history else {}
        metrics = {
            "test_accuracy": final.get("test_accuracy"),
            "train_accuracy": final.get("train_accuracy"),
            "train_loss": final.get("train_loss"),
            "train_seconds": train_seconds,
            "epochs": len(history),
            "world_size": group.world,
            "device": str(device),
            "config": run_config,
            "history": history,
            "tandem_version": tandem.__version__,
            "torch_version": torch.__version__,
        }
        written = ["checkpoint.pt"] if start_epoch < args.epochs else []  # an epoch ran: it wrote one
        error = write_run_files(
            args.out,
            json.dumps(metrics, indent=2),
            lambda path: bool(history) and _plot(history, path),
            written,
        )
        if error:  # rank 0 alone, after the last collective: the others have ended
            print(error, file=sys.stderr, flush=True)
            return 1
        accuracy = f"{metrics['test_accuracy']:.4f}" if history else "n/a"
        print(
            f"done: test accuracy {accuracy} after {len(history)} epochs, {train_seconds:.1f} s of "
            f"training; wrote {', '.join(written)} to {args.out}",
            flush=True,
        )
    return 0
