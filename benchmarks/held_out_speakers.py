"""Every speaker held out in turn: ``tandem train --test-speaker S`` with the defaults, over seeds.

    python benchmarks/held_out_speakers.py --out runs/speakers [--seeds 0 1 2] [--plot speakers.png] \
        [-- extra train options]

Each run trains on the other five speakers and tests on all 500 recordings of the held-out one (1,000
words); its metrics.json stays in ``--out/S/seed-N``. A line is printed as each run finishes, then a
Markdown table (per speaker: the final WER's mean and each seed's, the mean CER, best-epoch WER and
training seconds; last, the mean over the speakers) and, with ``--plot``, a bar chart of the mean WER
with each seed's as a dot. A run's draws move a speaker's WER by a point or more, so compare over seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# the checkout's src/ first, so the code measured is this checkout's (as benchmarks/run.py does)
_SRC = Path(__file__).resolve().parent.parent / "src"
_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_SRC), os.environ.get("PYTHONPATH")]))}

SPEAKERS = ("george", "jackson", "lucas", "nicolas", "theo", "yweweler")


def run_speaker(speaker: str, seed: int, out: Path, extra: list[str]) -> dict:
    """Train with ``speaker`` held out from ``seed``; metrics.json's summary plus the command's wall time."""
    folder = out / speaker / f"seed-{seed}"
    start = time.perf_counter()
    command = ["train", "--test-speaker", speaker, "--seed", str(seed), "--out", str(folder), *extra]
    done = subprocess.run(
        [sys.executable, "-m", "tandem", *command],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=_ENV,
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(
            f"held_out_speakers: {speaker}, seed {seed} failed ({done.returncode}):\n{done.stderr[-2000:]}"
        )
    metrics = json.loads((folder / "metrics.json").read_text())
    return {
        "speaker": speaker,
        "seed": seed,
        "wer": metrics["test_wer"],
        "cer": metrics["test_cer"],
        "best_wer": min(h["test_wer"] for h in metrics["history"]),
        "train_s": metrics["train_seconds"],
        "wall_s": wall,
    }


def summarise(runs: list[dict]) -> list[dict]:
    """One row per speaker (in the runs' order) from its runs over the seeds: the mean final WER, CER,
    best-epoch WER and training seconds, each seed's WER; then a row ``"all"`` of the speakers' means."""
    speakers = list(dict.fromkeys(r["speaker"] for r in runs))
    rows = []
    for speaker in speakers:
        mine = [r for r in runs if r["speaker"] == speaker]
        row = {k: statistics.fmean(r[k] for r in mine) for k in ("wer", "cer", "best_wer", "train_s")}
        rows.append({"speaker": speaker, **row, "wers": [r["wer"] for r in mine]})
    if len(rows) > 1:
        mean = {k: statistics.fmean(r[k] for r in rows) for k in ("wer", "cer", "best_wer", "train_s")}
        rows.append({"speaker": "all", **mean, "wers": []})
    return rows


def table(rows: list[dict], seeds: list[int]) -> str:
    lines = [
        f"| held out | test WER, mean | seed {' / '.join(map(str, seeds))} | test CER, mean "
        "| best epoch's WER, mean | training s, mean |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        each = " / ".join(f"{100 * w:.1f}" for w in r["wers"])
        lines.append(
            f"| {r['speaker']} | {100 * r['wer']:.1f}% | {each} | {100 * r['cer']:.1f}% | "
            f"{100 * r['best_wer']:.1f}% | {r['train_s']:.0f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["wers"]]  # not the mean over the speakers
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r["speaker"] for r in rows]
    seeds = len(rows[0]["wers"])
    ax.bar(names, [100 * r["wer"] for r in rows], label=f"final WER, mean of {seeds} seed(s)")
    for i, r in enumerate(rows):
        ax.plot([i] * len(r["wers"]), [100 * w for w in r["wers"]], ".", color="k", ms=5,
                label="each seed's WER" if i == 0 else None)  # fmt: skip
    ax.plot(names, [100 * r["cer"] for r in rows], "s", color="C1", label="final CER, mean")
    ax.set(ylabel="%", title="test error, each speaker held out (trained on the other five)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/speakers"))
    parser.add_argument("--speakers", nargs="+", default=list(SPEAKERS), choices=SPEAKERS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="tandem train --seed (default: 0)")
    parser.add_argument("--plot", type=Path, help="a bar chart of the error rates (needs matplotlib)")
    parser.add_argument("extra", nargs="*", help="after --: more options for tandem train")
    args = parser.parse_args()
    if any(a == "--seed" or a.startswith("--seed=") for a in args.extra):
        parser.error("--seed after --: give the seeds with --seeds")
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds: expected different seeds, got {args.seeds}")
    runs = []
    for speaker in args.speakers:
        for seed in args.seeds:
            runs.append(run_speaker(speaker, seed, args.out, args.extra))
            r = runs[-1]
            print(
                f"{speaker}, seed {seed}: test WER {100 * r['wer']:.2f}%, CER {100 * r['cer']:.2f}%, "
                f"{r['wall_s']:.0f} s",
                flush=True,
            )
    rows = summarise(runs)
    print(table(rows, args.seeds))
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
