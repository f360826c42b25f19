"""The bundled digits' source recordings as manifests, to time ``tandem train`` on real files.

    python benchmarks/fsdd_manifests.py --out runs/manifests [--recordings ../shared/data/fsdd/recordings]
    tandem train --train-manifest runs/manifests/train.jsonl --test-manifest runs/manifests/test.jsonl \\
        --epochs 8 --out runs/mine

Writes ``train.jsonl`` and ``test.jsonl`` (NeMo's convention, absolute paths) for the Free Spoken Digit
Dataset's WAV files as isolated words ("seven"): takes 0-4 the test set, 5-49 training, the dataset's
customary split. A run on them reads, resamples and featurises files in its DataLoader workers, as a run
on your own recordings does, where the bundled digits are generated in memory. Recordings too short for
their word under CTC at the default model's 40 ms an output frame are left out, as ``tandem train``
would refuse them (most are takes of "three", which needs 6 frames).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tandem.asr.corpus import DIGIT_WORDS
from tandem.asr.features import FeatureConfig
from tandem.asr.manifest import Entry, check_entry
from tandem.asr.model import ModelConfig
from tandem.asr.text import ENGLISH

_DEFAULT = Path(__file__).resolve().parents[2] / "shared" / "data" / "fsdd" / "recordings"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/manifests"))
    parser.add_argument("--recordings", type=Path, default=_DEFAULT, help="FSDD's folder of WAV files")
    args = parser.parse_args()
    files = sorted(args.recordings.glob("*_*_*.wav"))
    if not files:
        raise SystemExit(
            f"fsdd_manifests: --recordings {args.recordings}: no FSDD WAV files (digit_speaker_take.wav)"
        )
    features, model = FeatureConfig(), ModelConfig()
    lines: dict[str, list[str]] = {"train": [], "test": []}
    short = 0
    for number, path in enumerate(files, 1):
        digit, _speaker, take = path.stem.split("_")
        item = {"audio_filepath": str(path.resolve()), "text": DIGIT_WORDS[int(digit)]}
        # tandem train's own check of a manifest line: the only problem expected here is a recording
        # too short for its word
        entry = check_entry(item, args.out / "manifest.jsonl", number, ENGLISH, features, model)
        if not isinstance(entry, Entry):
            if "too short for its transcript" not in entry:
                raise SystemExit(f"fsdd_manifests: {entry}")
            short += 1
            continue
        item["duration"] = entry.samples / features.sample_rate
        lines["test" if int(take) < 5 else "train"].append(json.dumps(item))
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in lines.items():
        (args.out / f"{name}.jsonl").write_text("".join(row + "\n" for row in rows))
    print(
        f"fsdd_manifests: {len(lines['train'])} training and {len(lines['test'])} test recordings in "
        f"{args.out}; {short} left out as too short for their word"
    )


if __name__ == "__main__":
    main()
