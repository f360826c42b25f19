"""``tandem bench --op transcribe``: the recognizer's inference speed as a real-time factor (RTF: seconds
of compute per second of audio), tandem's model against the same weights in torch's modules.

The audio is the bundled test utterances (connected digits of the customary test split, planned with
``tandem train``'s test seed), the first ``count`` of them, transcribed ``batch`` at a time, longest
first as :class:`tandem.asr.Recognizer` batches them. The timed unit is what differs between the two
builds of the network: the model's forward (eval mode, under ``torch.inference_mode``) and greedy
decoding, on log-mel features computed beforehand. The features are the same for both and are timed
on their own; the summary under the table gives each provider's RTF, the features' RTF, and their sum
(end to end, audio already read and at the model's rate).

Weights do not change the speed: the model is a fresh default ``ModelConfig`` (GRU or LSTM 3x128,
bidirectional) with a fixed seed, its state_dict loaded into the torch build; the summary says whether
both builds gave the same transcripts.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor

from tandem.bench.registry import OpBench, Shape, register

__all__ = ["TRANSCRIBE_BENCH", "RESULTS", "summary", "TARGET_RTF"]

TARGET_RTF = 0.02  # the target on the 2-core CPU machine
RESULTS: dict[str, dict[str, Any]] = {}  # shape id -> audio seconds, feature seconds, transcripts


@lru_cache(maxsize=1)
def _test_audio() -> tuple[tuple[Tensor, ...], int]:
    """The test utterances in plan order (8 kHz float32) and their sample rate."""
    from tandem.asr.corpus import load_spoken_digits
    from tandem.asr.generator import ConnectedDigits, split_recordings
    from tandem.asr.training import TEST_SEED

    recordings = load_spoken_digits()
    digits = ConnectedDigits(recordings, split_recordings(recordings)[1])
    return tuple(digits.render(u) for u in digits.plan(TEST_SEED)), recordings.sample_rate


def _batches(
    count: int, batch: int, device: torch.device
) -> tuple[list[tuple[Tensor, Tensor]], float, float]:
    """Features and frames of the first ``count`` test utterances, ``batch`` per forward, longest first;
    the audio's seconds, and the median seconds LogMel took over them (5 runs)."""
    from tandem.asr.features import FeatureConfig, LogMel

    audio, rate = _test_audio()
    if not 0 < count <= len(audio):
        raise ValueError(f"bench transcribe: expected 1 to {len(audio)} utterances (count), got {count}")
    chosen = sorted(audio[:count], key=len, reverse=True)
    logmel = LogMel(FeatureConfig(sample_rate=rate)).to(device)
    groups = [chosen[i : i + batch] for i in range(0, count, batch)]
    padded = [
        (
            torch.nn.utils.rnn.pad_sequence(list(g), batch_first=True).to(device),
            torch.tensor([len(a) for a in g]),
        )
        for g in groups
    ]
    seconds, out = [], []
    with torch.inference_mode():
        for _ in range(5):
            start = time.perf_counter()
            out = [logmel(w, n) for w, n in padded]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
    return out, sum(len(a) for a in chosen) / rate, statistics.median(seconds)


def _provider(stack: str):
    def factory(p: dict[str, Any], device: torch.device, mode: str):
        from tandem.asr.decode import greedy_decode
        from tandem.asr.model import TANDEM_PARTS, TORCH_PARTS, DeepSpeech2, ModelConfig
        from tandem.asr.text import ENGLISH

        config = ModelConfig(cell=p["cell"])
        with torch.random.fork_rng():
            torch.manual_seed(0)  # the same weights for both stacks, and in every run
            weights = DeepSpeech2(config, TORCH_PARTS).state_dict()
        model = DeepSpeech2(config, TANDEM_PARTS if stack == "tandem" else TORCH_PARTS)
        model.load_state_dict(weights)
        model.to(device).eval()
        batches, audio_seconds, feature_seconds = _batches(p["count"], p["batch"], device)

        def thunk() -> list[str]:
            texts = []
            with torch.inference_mode():
                for features, frames in batches:
                    log_probs, out_frames = model(features, frames)
                    texts += greedy_decode(log_probs, out_frames, ENGLISH)
            return texts

        result = RESULTS.setdefault(p["id"], {"texts": {}})
        result.update(audio_seconds=audio_seconds, feature_seconds=feature_seconds, utterances=p["count"])
        result["texts"][stack] = thunk()
        return thunk

    return factory


def _shape(cell: str, batch: int, count: int, quick: bool = False) -> Shape:
    id_ = f"{cell}-3x128-test{count}-B{batch}"
    return Shape(id_, dict(id=id_, cell=cell, batch=batch, count=count), quick=quick)


def summary(rows: Sequence[Any]) -> str:
    """Each shape's RTF per provider (model + decoding), the features' RTF and the end-to-end sum."""
    lines = []
    for shape in dict.fromkeys(r.shape for r in rows):
        res = RESULTS.get(shape)
        if res is None:
            continue
        audio, features = res["audio_seconds"], res["feature_seconds"]
        rtf = {r.provider: r.p50_ms / 1e3 / audio for r in rows if r.shape == shape}
        texts = res["texts"]
        same = "same" if len({tuple(t) for t in texts.values()}) == 1 else "DIFFERENT"
        parts = ", ".join(f"{name} {value:.4f}" for name, value in rtf.items())
        ends = ", ".join(f"{name} {value + features / audio:.4f}" for name, value in rtf.items())
        lines.append(
            f"{shape}: {res['utterances']} utterances, {audio:.1f} s of audio; RTF (model + greedy decoding, "
            f"p50) {parts}; features (LogMel, same for both) {features / audio:.4f}; end to end {ends} "
            f"(target <= {TARGET_RTF}); {same} transcripts"
        )
    return "\n".join(lines)


TRANSCRIBE_BENCH = register(
    OpBench(
        op="transcribe",
        providers={"torch": _provider("torch"), "tandem": _provider("tandem")},
        shapes=(
            _shape("gru", 32, 32, quick=True),
            _shape("gru", 1, 8),
            _shape("lstm", 32, 32),
        ),
        modes=("fwd",),
        description="recognizer inference (model forward + greedy decoding, eval, inference_mode) on the "
        "test utterances: real-time factor, tandem's model vs the same weights in torch's modules",
        extra={"summary": summary},
    )
)
