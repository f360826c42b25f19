"""Every speaker held out in turn: ``tandem train --test-speaker S`` with the defaults, one run each.

    python benchmarks/held_out_speakers.py --out runs/speakers [--plot speakers.png] [-- extra train options]

Each run trains on the other five speakers and tests on all 500 recordings of the held-out one (1,000
words); its metrics.json stays in ``--out/S``. A line is printed as each run finishes, then a Markdown
table (final and best-epoch WER, CER, training seconds, wall seconds) and, with ``--plot``, a bar chart.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# the checkout's src/ first, so the code measured is this checkout's (as benchmarks/run.py does)
_SRC = Path(__file__).resolve().parent.parent / "src"
_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_SRC), os.environ.get("PYTHONPATH")]))}

SPEAKERS = ("george", "jackson", "lucas", "nicolas", "theo", "yweweler")


def run_speaker(speaker: str, out: Path, extra: list[str]) -> dict:
    """Train with ``speaker`` held out; metrics.json's summary plus the wall time of the command."""
    folder = out / speaker
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "tandem", "train", "--test-speaker", speaker, "--out", str(folder), *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=_ENV,
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"held_out_speakers: {speaker} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    metrics = json.loads((folder / "metrics.json").read_text())
    wers = [h["test_wer"] for h in metrics["history"]]
    return {
        "speaker": speaker,
        "wer": metrics["test_wer"],
        "cer": metrics["test_cer"],
        "best_wer": min(wers),
        "best_epoch": wers.index(min(wers)) + 1,
        "train_s": metrics["train_seconds"],
        "wall_s": wall,
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| held out | test WER | test CER | best epoch's WER | training s | wall s |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['speaker']} | {100 * r['wer']:.1f}% | {100 * r['cer']:.1f}% | "
            f"{100 * r['best_wer']:.1f}% (epoch {r['best_epoch']}) | {r['train_s']:.0f} | {r['wall_s']:.0f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r["speaker"] for r in rows]
    ax.bar(names, [100 * r["wer"] for r in rows], label="final WER")
    ax.plot(names, [100 * r["cer"] for r in rows], "s", color="C1", label="final CER")
    ax.set(ylabel="%", title="test error, each speaker held out (trained on the other five)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/speakers"))
    parser.add_argument("--speakers", nargs="+", default=list(SPEAKERS), choices=SPEAKERS)
    parser.add_argument("--plot", type=Path, help="a bar chart of the error rates (needs matplotlib)")
    parser.add_argument("extra", nargs="*", help="after --: more options for tandem train")
    args = parser.parse_args()
    rows = []
    for speaker in args.speakers:
        rows.append(run_speaker(speaker, args.out, args.extra))
        r = rows[-1]
        line = f"{speaker}: test WER {100 * r['wer']:.2f}%, CER {100 * r['cer']:.2f}%, {r['wall_s']:.0f} s"
        print(line, flush=True)
    print(table(rows))
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
