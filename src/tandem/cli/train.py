"""``tandem train`` (demo): a few Adagrad steps of a small bidirectional tandem.nn.GRU classifier.

A placeholder that the training issue replaces with the real job (speech data, data parallel,
checkpoints). It already runs real code: synthetic sequences whose class shifts the mean of one input
feature, a bidirectional ``tandem.nn.GRU``, mean pooling over time, a linear head, and
``torch.optim.Adagrad``; it prints the loss of every step and the final training accuracy.

Example::

    tandem train --steps 20
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn

from tandem.cli._args import positive_float, positive_int

__all__ = ["DESCRIPTION", "add_arguments", "run", "GRUClassifier"]

DESCRIPTION = (
    "Demo until the training job lands: a few Adagrad steps of a small bidirectional tandem.nn.GRU "
    "classifier on synthetic sequences, printing the loss of every step."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the ``tandem train`` demo."""
    parser.add_argument("--steps", type=positive_int, default=30, help="Adagrad steps (default: 30)")
    parser.add_argument(
        "--batch-size", type=positive_int, default=32, help="sequences per step (default: 32)"
    )
    parser.add_argument("--hidden", type=positive_int, default=32, help="GRU hidden size (default: 32)")
    parser.add_argument(
        "--lr", type=positive_float, default=0.05, help="Adagrad learning rate (default: 0.05)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")


class GRUClassifier(nn.Module):
    """Bidirectional GRU over ``[B, T, F]`` frames, mean pooled over time, then a linear layer to logits."""

    def __init__(self, gru_cls: type[nn.Module], features: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.gru = gru_cls(features, hidden, num_layers=1, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output, _ = self.gru(x)  # output: [B, T, 2H]
        return self.head(output.mean(dim=1))


def _synthetic(n: int, steps: int, features: int, classes: int, gen: torch.Generator):
    # Class c lifts feature c by one standard deviation at every frame: learnable in a few steps, but
    # only by reading the sequence.
    y = torch.randint(classes, (n,), generator=gen)
    x = torch.randn(n, steps, features, generator=gen)
    x[torch.arange(n), :, y] += 1.0
    return x, y


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the demo with parsed ``args``; returns the exit status."""
    try:
        from tandem.nn import GRU
    except ImportError as e:
        print(
            f"tandem train: tandem.nn.GRU is not available in this build of tandem ({e}); the demo needs it",
            file=sys.stderr,
        )
        return 1

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    features, classes, frames = 8, 4, 20
    x, y = _synthetic(16 * args.batch_size, frames, features, classes, gen)
    model = GRUClassifier(GRU, features, args.hidden, classes)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()

    print(
        f"tandem train (demo): bidirectional tandem.nn.GRU(hidden={args.hidden}) on {len(y)} synthetic "
        f"sequences of {frames} frames, {classes} classes; Adagrad lr={args.lr}"
    )
    start = time.perf_counter()
    for step in range(args.steps):
        idx = torch.randint(len(y), (args.batch_size,), generator=gen)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x[idx]), y[idx])
        loss.backward()
        optimizer.step()
        print(f"step {step + 1:>{len(str(args.steps))}}/{args.steps}  loss {loss.item():.4f}", flush=True)
    with torch.no_grad():
        accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
    print(f"train accuracy {accuracy:.3f} after {args.steps} steps, {time.perf_counter() - start:.1f} s")
    return 0
