"""Training a recognizer: one process of the data-parallel group (or the only one).

Every random choice depends only on the seed, the epoch and the utterance: the epoch's utterances and
their augmentation, the order of the batches, each rank's share. Each rank computes its share of every
global batch; tandem's SyncBatchNorm normalises over the whole global batch and its
DistributedDataParallel averages the gradients, and the loss is scaled so that the average is the global
batch's mean: N processes compute what one process computes on the concatenated batch. A resumed run
therefore ends with the weights of an uninterrupted one (same seed and number of processes).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import pickle
import random
import resource
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

import tandem
from tandem.asr.audio import AudioError
from tandem.asr.augment import FASTEST, Augmentation
from tandem.asr.batch import Batch, collate
from tandem.asr.checkpoint import (
    CheckpointError,
    CheckpointStore,
    CheckpointVersionError,
    CheckpointWriteError,
    atomic_write,
    write_run_files,
)
from tandem.asr.corpus import Recordings, load_spoken_digits
from tandem.asr.decode import greedy_decode
from tandem.asr.distributed import (
    Group,
    WorkerCores,
    pick_device,
    pin_to_cores,
    rank_threads,
    torchrun_int,
)
from tandem.asr.features import FeatureConfig, LogMel, saved_feature_settings
from tandem.asr.generator import ConnectedDigits, Utterance, split_recordings
from tandem.asr.interrupt import (
    LoaderWorkerInit,
    StopRequests,
    collective_exit,
    die_with_torchrun,
    end_workers,
    stop_signals_held,
)
from tandem.asr.manifest import Entry, ManifestError, ManifestSet, read_manifest
from tandem.asr.metrics import ErrorRates, error_rates
from tandem.asr.model import TORCH_PARTS, DeepSpeech2, ModelConfig
from tandem.asr.text import ENGLISH, Alphabet
from tandem.optim.adagrad import torch_fused_takes

__all__ = [
    "TrainConfig",
    "Checkpointing",
    "Run",
    "train",
    "data_mismatch",
    "resume_mismatch",
    "TEST_SEED",
    "EXIT_STOPPED",
    "EXIT_NOT_SAVED",
]

TEST_SEED = 20240502  # the test set's plan: fixed, so that every run is scored on the same utterances
TEST_PASSES = 2  # each test recording appears in two test utterances: 600 words on the customary split
TEST_CACHE_BYTES = 256 * 2**20  # test features kept between evaluations (the digits' take ~8 MB a rank)


@dataclass(frozen=True)
class TrainConfig:
    """A training run's settings (what a resume must agree on is in :meth:`resume_keys`)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    features: FeatureConfig = field(default_factory=FeatureConfig)
    # 48: on the 2-core machine (AMD EPYC, 2026-11-25 evening) seeds 0-2 reach test WER 1.00 / 1.17 / 1.17%
    # in 165-171 s of wall time, against 0.67 / 1.33 / 1.67% in 107-110 s with 32 (BENCHMARKS.md, train)
    epochs: int = 48
    batch_size: int = 32
    lr: float = 0.03
    warmup_steps: int = 50
    seed: int = 0
    test_speaker: str | None = None
    augment: bool = True
    alphabet: str = ENGLISH.characters
    # your own recordings (JSON-lines manifests, tandem.asr.manifest) instead of the bundled digits
    train_manifest: str | None = None
    test_manifest: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def resume_keys(self) -> dict[str, Any]:
        """Everything but the number of epochs: a resume may extend a run, nothing else."""
        return {k: v for k, v in self.to_dict().items() if k != "epochs"}


def _rng_state() -> dict[str, Any]:
    """Python's, numpy's and torch's global generators (the run derives its own draws from the seed, but
    code around it may use these), in types a ``weights_only`` checkpoint can hold."""
    np_state = np.random.get_state(legacy=False)
    return {
        "python": random.getstate(),
        "numpy": {**np_state, "state": {k: np.asarray(v).tolist() for k, v in np_state["state"].items()}},
        "torch": torch.get_rng_state(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = dict(state["numpy"])
    np_state["state"] = {
        k: np.asarray(v, dtype=np.uint32) if k == "key" else v for k, v in np_state["state"].items()
    }
    np.random.set_state(np_state)
    torch.set_rng_state(state["torch"])


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"model": {"hidden": 96}}`` as ``{"model.hidden": 96}``, tuples as lists (as stored)."""
    out: dict[str, Any] = {}
    for k, v in json.loads(json.dumps(d)).items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# The tandem train options of the settings a resume must agree on (the others have none: a checkpoint of
# another tandem version's defaults, say features.n_mels, is named by its key)
_OPTION_OF_SETTING = {
    "model.cell": "--cell",
    "model.hidden": "--hidden",
    "model.layers": "--layers",
    "model.conv_channels": "--conv-channels",
    "model.n_classes": "--alphabet (its size)",
    "batch_size": "--batch-size",
    "lr": "--lr",
    "features.normalize": "--normalize",
    "warmup_steps": "--warmup-steps",
    "seed": "--seed",
    "test_speaker": "--test-speaker",
    "augment": "--augment (on with --test-speaker by default)",
    "alphabet": "--alphabet",
    "train_manifest": "--train-manifest",
    "test_manifest": "--test-manifest",
}


def resume_mismatch(config: TrainConfig, world_size: int, state: dict[str, Any]) -> str | None:
    """Why a run of ``config`` on ``world_size`` processes cannot resume exactly from the checkpoint
    ``state`` (every setting but the number of epochs must agree), or None; each setting named by its
    option (it said "model.hidden", "processes")."""
    ours = _flat(config.resume_keys())
    saved = {k: v for k, v in state.get("train_config", {}).items() if k != "epochs"}
    if isinstance(saved.get("features"), dict):
        saved["features"] = saved_feature_settings(saved["features"])
    theirs = _flat(saved)
    differ = [
        f"{_OPTION_OF_SETTING.get(k, k)}: checkpoint {theirs.get(k)!r}, now {v!r}"
        for k, v in ours.items()
        if theirs.get(k) != v
    ]
    if state.get("world_size") != world_size:
        differ.append(
            f"processes (--nproc x --nnodes): checkpoint {state.get('world_size')}, now {world_size}"
        )
    if differ:
        return f"--resume: the run's settings differ from the checkpoint's ({'; '.join(differ)})"
    # more epochs continue the run; fewer than it has trained would end it with files of two moments
    epoch, position = int(state.get("epoch", 0)), int(state.get("position", 0))
    if config.epochs < epoch or (config.epochs == epoch and position > 0):
        at = f"{epoch} epochs and {position} batches" if position else f"{epoch} epochs"
        least = epoch + (position > 0)
        return (
            f"--epochs {config.epochs}: the checkpoint has trained {at}; resume with --epochs {least} or more"
        )
    return None


def _batches(plan: list[Utterance], size: int, world: int, rng: np.random.Generator) -> list[list[Utterance]]:
    """Global batches of utterances of similar length (little padding, short time loops), in random order.
    A last batch too small to give every rank an utterance joins the one before it (dropping it left out
    the same longest recordings every epoch); a plan of fewer utterances than ranks has no batch."""
    by_length = sorted(plan, key=lambda u: u.length)
    batches = [by_length[i : i + size] for i in range(0, len(by_length), size)]
    if len(batches) > 1 and len(batches[-1]) < world:
        last = batches.pop()
        batches[-1] = batches[-1] + last
    batches = [b for b in batches if len(b) >= world]
    return [batches[i] for i in rng.permutation(len(batches))]


def epoch_batches(train_set: Any, config: TrainConfig, epoch: int, world: int) -> list[list[Utterance]]:
    """The global batches of ``epoch``, in order: a function of the seed and the epoch alone."""
    plan = train_set.plan((config.seed, epoch))
    return _batches(plan, config.batch_size, world, np.random.default_rng((config.seed, epoch, 1)))


def _share(batch: list[Utterance], rank: int, world: int) -> list[Utterance]:
    """This rank's part of a global batch: dealt by length, so every rank gets as much audio."""
    return sorted(batch, key=lambda u: u.length)[rank::world]


STACKS = ("tandem", "torch")


@dataclass(frozen=True)
class DataSets:
    """What a run trains and tests on: sets with ``plan(seed, passes)`` and ``render(utterance)``
    (:class:`~tandem.asr.generator.ConnectedDigits`, :class:`~tandem.asr.manifest.ManifestSet`), and how
    many times the test plan uses each test recording."""

    train: Any
    test: Any
    test_passes: int = 1

    def fingerprints(self) -> dict[str, str] | None:
        """The manifests' :meth:`~tandem.asr.manifest.ManifestSet.fingerprint` (``train``, ``test``), or
        None for the bundled digits (the project's own file, checked by its test)."""
        if not isinstance(self.train, ManifestSet):
            return None
        return {"train": self.train.fingerprint(), "test": self.test.fingerprint()}


def data_mismatch(ours: dict[str, str] | None, state: dict[str, Any]) -> str | None:
    """Why a run on data of :meth:`DataSets.fingerprints` ``ours`` cannot continue from the checkpoint
    ``state``: a manifest whose recordings changed since (a line added, removed, moved or edited, a
    recording of another length), or None."""
    theirs = state.get("data_fingerprints")
    if ours is None or theirs is None:  # the bundled digits, or a checkpoint written before the check
        return None
    changed = [f"--{k}-manifest" for k in ("train", "test") if ours[k] != theirs.get(k)]
    if not changed:
        return None
    return (
        f"--resume: the recordings of {' and '.join(changed)} differ from the ones the checkpoint's run "
        "trained on (a line added, removed, moved or edited, or a recording of another length): the run "
        "would not continue as it began. Put the manifest back as it was, or start a new run without --resume"
    )


# The training utterances' gain range with augmentation, against the generator's -10..6 dB. The speakers'
# recordings differ by ~19 dB in level (RMS 0.010 for theo to 0.091 for jackson) over the same noise
# floor, so a quiet voice held out meets signal-to-noise ratios that the louder training voices never
# have. Measured with theo held out: test WER 12.1% against 14.3% (the defaults, seed 0); one process,
# seeds 0 and 1: CER 5.8% / 6.7% against 7.5% / 7.1%, WER 11.5% / 13.6% against 14.2% / 13.5%.
AUGMENTED_GAIN_DB = (-30.0, 6.0)


# The training utterances' silences before the first word and after the last, against the generator's
# 20-200 ms: people's own recordings are often cut close to the speech (the bundled ones are), which a
# model that never met an utterance starting on its first word transcribed badly. Measured with the
# defaults, seed 0, `tandem transcribe` of the 3,000 bundled recordings as they are: 10.3% WER against
# 14.7% (and 0.67 / 1.00 / 1.33% test WER for seeds 0-2 against 1.00 / 1.17 / 1.17%).
TRAIN_EDGE_MS = (0.0, 200.0)


def digit_sets(recordings: Recordings, test_speaker: str | None = None, augment: bool = False) -> DataSets:
    """The bundled digits: the customary split, or one speaker held out (see ``split_recordings``). The
    training utterances' edges span :data:`TRAIN_EDGE_MS`; with ``augment`` their gains span
    :data:`AUGMENTED_GAIN_DB`; the test set is the generator's, the same either way."""
    train_ids, test_ids = split_recordings(recordings, test_speaker)
    train = (
        ConnectedDigits(recordings, train_ids, gain_db=AUGMENTED_GAIN_DB, edge_ms=TRAIN_EDGE_MS)
        if augment
        else ConnectedDigits(recordings, train_ids, edge_ms=TRAIN_EDGE_MS)
    )
    return DataSets(train, ConnectedDigits(recordings, test_ids), TEST_PASSES)


class _Steps(torch.utils.data.Sampler):
    """The (epoch, position) pairs from a run's position to its end, made as they are read: an epoch's
    count of batches is drawn when its first step is reached (all of them at the start kept a run of
    10,000 epochs from its first step for minutes, silently)."""

    def __init__(self, run: Run) -> None:
        self.run, self.epoch, self.position = run, run.epoch, run.position

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for epoch in range(self.epoch, self.run.config.epochs):
            for position in range(self.position if epoch == self.epoch else 0, self.run.batch_count(epoch)):
                yield epoch, position


class _Shares(torch.utils.data.Dataset):
    """Item ``(epoch, position)``: this rank's collated share of that step's global batch, with the size
    of the global batch and the recordings that could not be read (see :func:`_render`). Picklable, so
    DataLoader workers can make the batches."""

    def __init__(self, run: Run) -> None:
        self.train_set, self.logmel, self.alphabet = run.train_set, run.logmel, run.alphabet
        self.augmentation, self.config = run.augmentation, run.config
        self.rank, self.world = run.group.rank, run.group.world
        self._epoch: tuple[int, list[list[Utterance]]] | None = None

    def __getitem__(self, step: tuple[int, int]) -> tuple[Batch, int, list[str]]:
        epoch, position = step
        if self._epoch is None or self._epoch[0] != epoch:
            self._epoch = (epoch, epoch_batches(self.train_set, self.config, epoch, self.world))
        global_batch = self._epoch[1][position]
        mine = _share(global_batch, self.rank, self.world)
        problems: list[str] = []
        batch = collate(
            _render(self.train_set, mine, problems),
            [u.transcript for u in mine],
            self.logmel,
            self.alphabet,
            self.augmentation,
            [u.seed for u in mine],
        )
        return batch, len(global_batch), problems


class BadRecordings(Exception):
    """Recordings that could not be read during the run, on any rank; raised on every rank alike, after a
    collective. ``mine``: this rank's messages (each names its file and manifest line)."""

    def __init__(self, mine: list[str]) -> None:
        super().__init__("; ".join(mine) or "a recording could not be read on another rank")
        self.mine = mine


def _render(data_set: Any, utterances: Sequence, problems: list[str]) -> list[Tensor]:
    """``data_set.render`` of each utterance. The manifests' check before the run reads headers, not
    samples: a recording found unreadable now (NaN samples, a file cut short or removed since) adds its
    message to ``problems`` and stands in as silence, so that this rank still takes its part in the
    collectives of the step, after which every rank ends the run together (no rank fails alone, and
    torchrun does not restart the ranks into the same recording)."""
    audio = []
    for u in utterances:
        try:
            audio.append(data_set.render(u))
        except AudioError as e:
            problems.append(str(e))
            audio.append(torch.zeros(max(1, int(u.length))))
    return audio


class Run:
    """One rank's training run: data, model, optimizer, schedule, steps, evaluation and checkpoint state.

    ``stack`` picks the parts: ``"tandem"`` (tandem.nn.GRU/LSTM, SyncBatchNorm, tandem.optim.Adagrad,
    tandem.parallel.DistributedDataParallel) or ``"torch"``, the same model from torch's parts for the
    side-by-side benchmark (torch.nn.GRU/LSTM, BatchNorm1d, whose statistics stay per process, as
    torch.nn.SyncBatchNorm refuses CPU tensors; torch.optim.Adagrad, fused where torch has the kernel;
    torch's DDP).
    """

    def __init__(self, config: TrainConfig, group: Group, data: DataSets, stack: str = "tandem") -> None:
        if stack not in STACKS:
            raise ValueError(f"Run: expected stack in {STACKS}, got {stack!r}")
        self.config, self.group = config, group
        self.device = group.device
        self.alphabet = Alphabet(config.alphabet)
        self.train_set, self.test_set = data.train, data.test
        self.fingerprints = data.fingerprints()  # once: each checkpoint holds them
        self.test_plan = sorted(
            self.test_set.plan(TEST_SEED, passes=data.test_passes), key=lambda u: u.length
        )
        self._test_cache: tuple[int, list[Batch]] | None = None
        self.logmel = LogMel(config.features)
        self.augmentation = Augmentation() if config.augment else None

        torch.manual_seed(config.seed)
        if stack == "tandem":
            self.model = DeepSpeech2(config.model).to(self.device)
            ddp = tandem.parallel.DistributedDataParallel
            self.optimizer = tandem.optim.Adagrad(self.model.parameters(), lr=config.lr)
        else:
            self.model = DeepSpeech2(config.model, TORCH_PARTS).to(self.device)
            ddp = torch.nn.parallel.DistributedDataParallel
            fused = {"fused": True} if torch_fused_takes(self.device) else {"foreach": True}
            self.optimizer = torch.optim.Adagrad(self.model.parameters(), lr=config.lr, **fused)
        self.wrapped = ddp(self.model) if group.world > 1 else self.model
        self.ctc = torch.nn.CTCLoss(blank=0, reduction="none", zero_infinity=True)
        # where the run is: epoch, batches done in it, optimizer steps, and the epoch's loss so far (the
        # sum over ranks of every step's, in step order, so a resumed epoch adds up to the same float)
        self.epoch = self.position = self.step = 0
        self.epoch_loss = self.epoch_count = 0.0
        # steps of the whole run: every epoch has (nearly) as many batches as the first
        self._batch_counts: dict[int, int] = {}
        self.total_steps = config.epochs * self.batch_count(0)
        self.history: list[dict[str, Any]] = []
        self.seconds_before = 0.0
        # when the current epoch began, on this process's clock (set by the loop; a resumed epoch's start
        # is moved back by the seconds it trained before its checkpoint, "epoch_seconds")
        self.epoch_started = time.perf_counter()
        self.epoch_seconds_before = 0.0

    # ---- checkpoints
    def state(self) -> dict[str, Any]:
        """Everything to rebuild the recognizer and to continue this run exactly where it is."""
        return {
            "model_config": self.config.model.to_dict(),
            "feature_config": self.config.features.to_dict(),
            "alphabet": self.alphabet.characters,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "train_config": self.config.to_dict(),
            "world_size": self.group.world,
            "epoch": self.epoch,
            "position": self.position,
            "step": self.step,
            "epoch_loss": self.epoch_loss,
            "epoch_count": self.epoch_count,
            "history": self.history,
            "train_seconds": self.seconds_before,
            # the current epoch's seconds so far, which a resume adds to its record's (it counted only the
            # resumed part); none at an epoch's end
            "epoch_seconds": time.perf_counter() - self.epoch_started if self.position else 0.0,
            "rng": _rng_state(),
            "data_fingerprints": self.fingerprints,
        }

    def mismatch(self, state: dict[str, Any]) -> str | None:
        """Why this run cannot continue from the checkpoint ``state`` (:func:`resume_mismatch`, then
        :func:`data_mismatch`), or None."""
        problem = resume_mismatch(self.config, self.group.world, state)
        return problem or data_mismatch(self.fingerprints, state)

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's ``state`` (checked with :meth:`mismatch` first)."""
        problem = self.mismatch(state)
        if problem:
            raise CheckpointError(problem)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.epoch, self.step = state["epoch"], state["step"]
        self.position = state.get("position", 0)
        self.epoch_loss, self.epoch_count = state.get("epoch_loss", 0.0), state.get("epoch_count", 0.0)
        self.history, self.seconds_before = state["history"], state["train_seconds"]
        self.epoch_seconds_before = state.get("epoch_seconds", 0.0) if self.position else 0.0
        if "rng" in state:
            _set_rng_state(state["rng"])

    def batch_count(self, epoch: int) -> int:
        """How many global batches ``epoch`` has (:func:`epoch_batches`, a function of the seed and the
        epoch alone), drawn once a process: an epoch's plan takes 20-40 ms (the digits'), which the loop
        paid again at every epoch's start."""
        if epoch not in self._batch_counts:
            batches = epoch_batches(self.train_set, self.config, epoch, self.group.world)
            self._batch_counts[epoch] = len(batches)
        return self._batch_counts[epoch]

    # ---- steps
    def learning_rate(self) -> float:
        """The schedule: linear warm-up from a tenth of ``lr`` over ``warmup_steps`` steps, then a cosine
        decay to ``lr / 50`` at the last step (Adagrad shrinks its steps too, but only where gradients
        were large; the decay settles the final weights everywhere)."""
        cfg, step = self.config, self.step
        if step < cfg.warmup_steps:
            return cfg.lr * (0.1 + 0.9 * step / cfg.warmup_steps)
        span = max(1, self.total_steps - cfg.warmup_steps)
        done = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.lr * (0.02 + 0.98 * 0.5 * (1 + math.cos(math.pi * done)))

    def batches(
        self, workers: int = 0, worker_cores: list[int] | None = None
    ) -> Iterator[tuple[Batch, int, list[str]]]:
        """This rank's share of every remaining step's global batch, from the current position to the end of
        the run, as (collated batch, utterances in the global batch, the recordings that could not be read).
        With ``workers`` > 0, DataLoader worker processes read, augment and compute features ahead of the
        steps, on ``worker_cores`` when given (a pinned rank's: the cores it had before, see
        :class:`WorkerCores`)."""
        steps, shares = _Steps(self), _Shares(self)
        if workers == 0:
            return map(shares.__getitem__, steps)
        with warnings.catch_warnings():
            if worker_cores is not None and workers <= len(worker_cores):
                # torch weighs the workers against the cores of the pinned rank (one, say) and warns of
                # "excessive worker creation", twice; they run on the cores the rank had before
                warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
            loader = torch.utils.data.DataLoader(
                shares, batch_size=None, sampler=steps, num_workers=workers, prefetch_factor=4,
                worker_init_fn=LoaderWorkerInit(None if worker_cores is None else WorkerCores(worker_cores)),
            )  # fmt: skip
            with stop_signals_held():  # until the workers ignore them (see LoaderWorkerInit)
                try:
                    return iter(loader)
                except BaseException:
                    # workers it started ignore the SIGTERM with which multiprocessing ends them at exit
                    for child in multiprocessing.active_children():
                        child.kill()
                    raise

    def train_step(self, batch: Batch, global_size: int) -> tuple[float, int]:
        """One optimizer step on this rank's ``batch`` of a global batch of ``global_size`` utterances;
        returns (the batch's summed per-utterance loss, its utterances)."""
        # The step's random draws (dropout) from a generator seeded by (seed, step, rank): each rank's
        # stream is its own and a resumed run draws what the uninterrupted one drew at the same step.
        torch.manual_seed(hash((self.config.seed, self.step, self.group.rank)) & (2**63 - 1))
        log_probs, out_frames = self.wrapped(batch.features.to(self.device), batch.frames)
        losses = self.ctc(log_probs, batch.targets.to(self.device), out_frames, batch.target_lengths)
        losses = losses / batch.target_lengths.to(losses)  # CTCLoss's "mean", per utterance
        # DDP averages over ranks: scaled so that the gradient is the global batch's mean
        loss = losses.sum() * (self.group.world / global_size)
        for g in self.optimizer.param_groups:
            g["lr"] = self.learning_rate()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.step += 1
        return float(losses.detach().sum()), len(batch)

    def step_and_sync(self, step: tuple[Batch, int], flags: tuple[float, ...] = ()) -> list[float]:
        """One step, then one all-reduce of (its loss, utterances, ``flags``...) over the ranks: the
        epoch's loss adds up the same way whether or not the run was resumed, and every rank learns
        the others' flags (stop, checkpoint) after the same step. Returns [the step's mean loss over
        the global batch, *the flags summed over the ranks]."""
        loss, n = self.train_step(*step)
        summed = self.group.sum([loss, n, *flags])
        self.position += 1
        self.epoch_loss += summed[0]
        self.epoch_count += summed[1]
        return [summed[0] / max(summed[1], 1.0), *summed[2:]]

    def end_epoch(self) -> tuple[float, int]:
        """Close the epoch: returns its loss (summed per-utterance) and utterances, and moves on."""
        loss, count = self.epoch_loss, int(self.epoch_count)
        self.epoch, self.position = self.epoch + 1, 0
        self.epoch_loss = self.epoch_count = 0.0
        return loss, count

    def train_epoch(self, progress: bool = False) -> tuple[float, int]:
        """The rest of the current epoch's steps (no checkpoints, no stopping: the benchmark's loop);
        returns the summed per-utterance loss and the utterances of all ranks."""
        count = self.batch_count(self.epoch)
        bar = tqdm(
            total=count, initial=self.position, desc=f"epoch {self.epoch + 1}/{self.config.epochs}",
            unit="batch", leave=False, disable=not progress,
        )  # fmt: skip
        steps = self.batches()
        while self.position < count:
            batch, size, problems = next(steps)
            if problems:
                raise BadRecordings(problems)
            self.step_and_sync((batch, size))
            bar.update()
        bar.close()
        return self.end_epoch()

    def _test_batches(self, batch_size: int, problems: list[str]) -> Iterator[Batch]:
        """This rank's share of the test set, collated in batches of ``batch_size``; recordings that could
        not be read go to ``problems`` (see :func:`_render`). The test set has no augmentation: the first
        evaluation keeps its batches for the next ones, up to :data:`TEST_CACHE_BYTES` of features (a
        larger test set is read and featurised each time)."""
        if self._test_cache is not None and self._test_cache[0] == batch_size:
            yield from self._test_cache[1]
            return
        mine = self.test_plan[self.group.rank :: self.group.world]
        kept: list[Batch] | None = []
        size = 0
        for i in range(0, len(mine), batch_size):
            part = mine[i : i + batch_size]
            batch = collate(
                _render(self.test_set, part, problems),
                [u.transcript for u in part],
                self.logmel,
                self.alphabet,
            )
            size += batch.features.nbytes
            if size > TEST_CACHE_BYTES:
                kept = None
            if kept is not None:
                kept.append(batch)
            yield batch
        if kept is not None and not problems:
            self._test_cache = (batch_size, kept)

    @torch.no_grad()
    def evaluate(self, batch_size: int = 48) -> tuple[ErrorRates, list[tuple[str, str]]]:
        """Error rates over the whole test set (summed over ranks) and a few (reference, hypothesis).
        Raises :class:`BadRecordings` on every rank if a test recording could not be read on any."""
        self.wrapped.eval()
        refs, hyps = [], []
        problems: list[str] = []
        for batch in self._test_batches(batch_size, problems):
            log_probs, out_frames = self.wrapped(batch.features.to(self.device), batch.frames)
            refs += batch.transcripts
            hyps += greedy_decode(log_probs, out_frames, self.alphabet)
        self.wrapped.train()
        *sums, unread = self.group.sum([*error_rates(refs, hyps).as_tuple(), float(len(problems))])
        if unread:
            raise BadRecordings(problems)
        rates = ErrorRates(*(int(v) for v in sums))
        return rates, list(zip(refs, hyps))[:: max(1, len(refs) // 4)][:4]


class _Board:
    """TensorBoard event files in ``folder`` (rank 0 passes its ``--out``, the others None) when the
    ``tensorboard`` package is installed: per step the loss and learning rate, per epoch the test error
    rates and a few test transcripts. Without it nothing is written. A resumed run drops the events
    after its checkpoint's step (``purge_step``), so the curves show the run that continued."""

    def __init__(self, folder: Path | None, step: int) -> None:
        self.writer = None
        if folder is None:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # torch raises it when the tensorboard package is missing
            return
        self.writer = SummaryWriter(log_dir=str(folder), purge_step=step or None)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is not None:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)

    def epoch(self, step: int, record: dict[str, Any], examples: list[tuple[str, str]]) -> None:
        if self.writer is None:
            return
        self.scalars(step, {f"test/{k.removeprefix('test_')}": record[k] for k in ("test_wer", "test_cer")})
        self.scalars(
            step,
            {"test/utterance_accuracy": record["test_accuracy"], "train/epoch_loss": record["train_loss"]},
        )
        lines = "\n".join(f"    {ref!r} -> {hyp!r}" for ref, hyp in examples)  # indented: Markdown code
        self.writer.add_text("test/transcripts", f"epoch {record['epoch']}:\n\n{lines}", step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _plot(history: list[dict[str, Any]], path: Path) -> bool:
    """Loss and error-rate curves as a PNG; False (and a note) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print(
            "tandem train: matplotlib is not installed, so no training-curve PNG (pip install tandem[plot])"
        )
        return False
    epochs = [h["epoch"] for h in history]
    fig, (ax_loss, ax_err) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(epochs, [h["train_loss"] for h in history], marker="o")
    ax_loss.set(xlabel="epoch", ylabel="CTC loss per character", title="training loss", yscale="log")
    ax_err.plot(epochs, [100 * h["test_wer"] for h in history], marker="o", label="WER")
    ax_err.plot(epochs, [100 * h["test_cer"] for h in history], marker="s", label="CER")
    ax_err.set(xlabel="epoch", ylabel="%", title="test error rates")
    # logarithmic down to 0.1 % and linear below, so that an epoch at 0 % is drawn (a log axis drops it)
    ax_err.set_yscale("symlog", linthresh=0.1, linscale=0.3)
    ax_err.set_ylim(bottom=0)
    ax_err.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax_err.legend()
    for ax in (ax_loss, ax_err):
        ax.grid(alpha=0.3, which="both")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    fig.tight_layout()
    atomic_write(lambda tmp: fig.savefig(tmp, format="png", dpi=110), path)
    plt.close(fig)
    return True


@dataclass(frozen=True)
class Checkpointing:
    """When a run saves and what it keeps: every ``every`` optimizer steps (0: every ``seconds`` of
    training, decided on rank 0), at every epoch's end, and when stopped by a signal; the newest ``keep``
    numbered checkpoints stay (see :class:`~tandem.asr.checkpoint.CheckpointStore`)."""

    every: int = 0
    seconds: float = 60.0
    keep: int = 2


EXIT_STOPPED = 130  # as a shell reports a program ended by Ctrl-C
EXIT_NOT_SAVED = 1  # a checkpoint could not be written (a full disk); the run stops at that step


def train(
    config: TrainConfig,
    out: Path,
    *,
    resume: bool = False,
    device: str = "auto",
    timeout: float = 60.0,
    checkpointing: Checkpointing = Checkpointing(),
    threads: int | None = None,
    workers: int = 0,
) -> int:
    """Train (this rank's part of) a recognizer; rank 0 writes checkpoints as ``checkpointing`` says, and
    ``metrics.json`` and ``training_curve.png`` at the end. Returns the exit status: 0 done,
    :data:`EXIT_STOPPED` stopped by SIGINT or SIGTERM (after a checkpoint), 2 nothing to resume from or
    bad data, 1 a loss that became NaN or a checkpoint that could not be written (:data:`EXIT_NOT_SAVED`:
    the run stops there, keeping the checkpoints before it). Where tandem train's launcher set
    ``EXIT_FILE_ENV`` (:mod:`tandem.asr.interrupt`), a status other than 0 goes to that file and the
    process returns 0 instead, so that torchrun does not restart ranks into what ended them.

    Under torchrun the process dies with its agent, and a run restarted by torchrun (after a worker
    failed) continues from the newest complete checkpoint of this launch by itself. ``threads``: torch's
    CPU threads in this process (default: the machine's cores shared by its processes); ``workers``:
    DataLoader processes per rank that read, augment and compute features ahead of the steps (0: in
    the training loop).
    """
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_torchrun()
    stop = StopRequests().install()
    where = pick_device(device)
    threads = rank_threads(threads)
    worker_cores = None
    if where.type == "cpu":
        before = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        # before the process group, whose threads then stay on this rank's cores; its DataLoader workers
        # get the cores back
        if pin_to_cores(threads) is not None:
            worker_cores = before
    group = Group(where, timeout)
    try:
        torch.set_num_threads(threads)
        code = _train(config, Path(out), resume, group, checkpointing, stop, workers, worker_cores)
    finally:
        group.close()
    # a clean stop under torchrun is no failure to report or restart (0), which tandem train's launcher
    # still learns from the status file (a signal may have reached one worker, not the launcher); other
    # statuses are collective
    if code == EXIT_STOPPED and "TORCHELASTIC_RUN_ID" in os.environ:
        collective_exit(code)
        code = 0
    else:
        code = collective_exit(code)
    group.leave(code)
    return code


def _launch_wrote(checkpoint: Path) -> bool:
    """Whether this launch wrote ``checkpoint``, asked of a process that wrote none itself: a finished run
    resumed wrote none; a group that torchrun restarted after the launch's last checkpoint did (before
    the restart), where the file is newer than the launch (:data:`LAUNCHED_AT_ENV`; under a torchrun
    started by hand, any restart is taken to have)."""
    if torchrun_int("TORCHELASTIC_RESTART_COUNT", 0) == 0:
        return False
    try:
        launched = float(os.environ[LAUNCHED_AT_ENV])
    except (KeyError, ValueError):
        return checkpoint.exists()
    try:
        return checkpoint.stat().st_mtime >= launched
    except OSError:
        return False


def _starting_state(
    run: Run, store: CheckpointStore, resume: bool, group: Group
) -> tuple[dict[str, Any] | None, str | None]:
    """Rank 0 decides where the run starts, every rank gets its decision: (checkpoint state or None for a
    fresh start, or an error message). A fresh launch sets the folder's old checkpoints aside (into
    ``previous/``, said on stdout), so a restart by torchrun (``TORCHELASTIC_RESTART_COUNT`` > 0) finds
    only this launch's, and a run started without --resume by mistake loses nothing. Rank 0 first removes
    what a process of an earlier launch left half-written there (see :meth:`CheckpointStore.leftovers`)."""
    decision: tuple[dict[str, Any] | None, str | None] = (None, None)
    if group.lead:
        store.remove_leftovers()
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        if resume or restarted:
            try:
                state, path, skipped = store.latest()
            except CheckpointVersionError as e:  # refused, not skipped (see CheckpointStore.latest)
                return group.broadcast((None, f"--resume: {e}"))  # type: ignore[return-value]
            for problem in skipped:
                print(f"tandem train: skipping an unreadable checkpoint: {problem}", flush=True)
            if state is None and resume and not restarted:
                decision = (None, f"--resume: no readable checkpoint in {store.folder}")
            elif state is not None:
                mismatch = run.mismatch(state)
                if skipped and mismatch is None:
                    print(
                        f"tandem train: continuing from the previous complete checkpoint, {path}", flush=True
                    )
                decision = (None, mismatch) if mismatch else (state, None)
        else:
            store.set_aside_and_say()
    return group.broadcast(decision)  # type: ignore[return-value]


def _newest_checkpoint(store: CheckpointStore) -> str:
    """Which checkpoint a --resume would continue from, as a sentence."""
    return _newest(store)[0]


def _newest(store: CheckpointStore) -> tuple[str, bool]:
    """:func:`_newest_checkpoint`'s sentence, and whether there is one (the store read once)."""
    try:
        state, path, _ = store.latest()
    except CheckpointVersionError as e:
        return f"The newest is of another version ({e})", False
    if state is None:
        return f"No checkpoint of this run is in {store.folder}", False
    return f"The newest complete one is {path} (step {state.get('step')})", True


def _test_set_name(config: TrainConfig) -> str:
    if config.test_manifest:
        return config.test_manifest
    return f"speaker {config.test_speaker} held out" if config.test_speaker else "takes 0-4"


def _data_sets(config: TrainConfig, group: Group) -> tuple[DataSets | None, str | None]:
    """The bundled digits, or the manifests' recordings: rank 0 checks the manifests (every line, before
    anything is trained or written) and every rank gets its verdict: (data, None) or (None, the error)."""
    if config.train_manifest is None:
        return digit_sets(load_spoken_digits(), config.test_speaker, config.augment), None

    def check() -> tuple[Any, str | None]:
        try:
            return manifest_entries(config), None
        except ManifestError as e:
            return None, str(e)

    entries, error = group.from_lead(check)  # type: ignore[misc]
    if error:
        return None, error
    rate = config.features.sample_rate
    train, test = (
        ManifestSet(e, rate, f"--{which}-manifest") for e, which in zip(entries, ("train", "test"))
    )
    return DataSets(train, test, 1), None


# When tandem train's launcher started the ranks (time.time()): what a group torchrun restarted without a
# checkpoint of its own compares checkpoint.pt's time with, to say whether this launch wrote it
LAUNCHED_AT_ENV = "TANDEM_TRAIN_LAUNCHED_AT"
# A file where tandem train's launcher left the manifests' entries it checked (see manifest_entries)
CHECKED_MANIFESTS_ENV = "TANDEM_TRAIN_CHECKED_MANIFESTS"


def manifest_entries(config: TrainConfig) -> tuple[list[Entry], list[Entry]]:
    """Both manifests of ``config``, checked (raises :class:`~tandem.asr.manifest.ManifestError`). Where
    tandem train's launcher checked them already (``CHECKED_MANIFESTS_ENV`` names the file of
    :func:`save_checked_manifests`) and neither manifest has changed since, its entries: rank 0 checked
    every line again, as long again as the launcher's check (~50 s for LibriSpeech's 281k lines), at
    every launch and every restart. The recordings themselves are checked once a launch."""
    return checked_manifests(config)[1]


def checked_manifests(config: TrainConfig) -> tuple[tuple | None, tuple[list[Entry], list[Entry]]]:
    """:func:`manifest_entries` with the key of the manifests as they were before they were read (None
    where a manifest cannot be found), for :func:`save_checked_manifests`."""
    key = _manifests_key(config)  # before the check: a manifest edited meanwhile no longer matches it
    if key is not None and key in _CHECKED:  # by this process: the launcher's check of a one-process run
        return key, _CHECKED[key]
    saved = os.environ.get(CHECKED_MANIFESTS_ENV)
    if saved and key is not None:
        try:
            with open(saved, "rb") as f:
                saved_key, entries = pickle.load(f)
            if saved_key == key:
                return key, entries
        except Exception:  # an unreadable file of the launcher's: checked here instead
            pass
    alphabet = Alphabet(config.alphabet)
    train_options = {"least_frames": 2 if config.model.layers > 1 else 1}
    train_options["shortest"] = FASTEST if config.augment else (1, 1)
    read, problems = [], []
    for what, path, options in (
        ("--train-manifest", config.train_manifest, train_options),
        ("--test-manifest", config.test_manifest, {}),
    ):
        try:  # both, so that one error lists the problems of both (a second scan of a large corpus)
            read.append(read_manifest(path, alphabet, config.features, config.model, what=what, **options))
        except ManifestError as e:
            problems.append(str(e))
    if problems:
        raise ManifestError("\n".join(problems))
    train, test = read
    if key is not None:
        _CHECKED[key] = (train, test)
    return key, (train, test)


# the manifests this process checked, by _manifests_key
_CHECKED: dict[tuple, tuple[list[Entry], list[Entry]]] = {}


def save_checked_manifests(key: tuple | None, entries: tuple[list[Entry], list[Entry]], path: Path) -> bool:
    """Keep ``entries`` of the manifests that had ``key`` (:func:`checked_manifests`) in ``path`` for the
    ranks to reuse while the manifests stay as they were. False, and nothing kept, where it cannot be
    written (a full disk): the ranks check the manifests themselves then."""
    if key is None:
        return False
    try:
        with open(path, "wb") as f:
            pickle.dump((key, entries), f)
    except (OSError, pickle.PicklingError):
        Path(path).unlink(missing_ok=True)
        return False
    return True


def _manifests_key(config: TrainConfig) -> tuple | None:
    """What a manifest check's result depends on (each manifest's path, identity, size and times; the
    alphabet, features and model), or None if a manifest cannot be found. The change time, which no
    program can set back, tells an edit whose modification time was restored (``touch -r``)."""
    try:
        files = tuple(
            (str(Path(m).resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            for m in (config.train_manifest, config.test_manifest)
            for st in [os.stat(m)]
        )
    except (OSError, TypeError, ValueError):
        return None
    return (files, config.alphabet, repr(config.features), repr(config.model))


def _train(
    config: TrainConfig,
    out: Path,
    resume: bool,
    group: Group,
    checkpointing: Checkpointing,
    stop: StopRequests,
    workers: int,
    worker_cores: list[int] | None,
) -> int:
    lead = group.lead
    data, error = _data_sets(config, group)
    if error:
        if lead:
            print(f"tandem train: error: {error}", file=sys.stderr, flush=True)
        return 2
    run = Run(config, group, data)
    store = CheckpointStore(out, checkpointing.keep)
    state, error = _starting_state(run, store, resume, group)
    if error:
        if lead:
            print(f"tandem train: error: {error}", file=sys.stderr, flush=True)
        return 2
    if state is not None:
        run.restore(state)
        del state
    cfg = config.model
    if lead:
        n_params = sum(p.numel() for p in run.model.parameters())
        where = ""
        if run.step and run.epoch >= config.epochs:  # (an epoch past the last is no place to resume at)
            where = f"; its checkpoint has trained all {config.epochs} epoch(s) (a larger --epochs trains on)"
        elif run.step:
            where = f"; resuming at step {run.step} (epoch {run.epoch + 1}, batch {run.position})"
        print(
            f"tandem train: speech recognition, {cfg.conv_layers} conv + {cfg.layers} bidirectional "
            f"{cfg.cell.upper()} x {cfg.hidden} ({n_params / 1e6:.2f} M parameters); "
            f"{len(run.train_set.ids)} training recordings, {len(run.test_plan)} test utterances "
            f"({_test_set_name(config)}); "
            f"{group.world} process(es) on {group.device}, global batch {config.batch_size}, "
            f"Adagrad lr {config.lr}{where}",
            flush=True,
        )

    started = last_save = time.perf_counter()
    stopped = not_saved = False
    board = _Board(out if lead else None, run.step)

    saves = 0  # the checkpoints this launch wrote (rank 0)

    def save() -> bool:
        """Rank 0 writes a checkpoint; False on every rank if it could not (every rank calls this after
        the same step, and learns the outcome from one all-reduce)."""
        nonlocal last_save, saves
        run.seconds_before += time.perf_counter() - last_save
        last_save = time.perf_counter()
        problem = advice = None
        if lead and not all(bool(torch.isfinite(p).all()) for p in run.model.parameters()):
            # never a checkpoint of NaN or infinite weights: the ones kept stay the last finite ones
            problem, advice = "the weights are no longer finite (NaN or inf); not written", ""
        elif lead:
            try:
                store.save(run.state(), run.step)
                saves += 1
            except CheckpointWriteError as e:
                problem, advice = str(e), ": make room, then run the same command"
        if group.sum([float(problem is not None)])[0] == 0:
            return True
        if lead:
            newest, found = _newest(store)
            if advice and found:  # (with none, --resume would find nothing)
                advice += " with --resume"
            # through tqdm: on a line of its own, not after the progress bar
            tqdm.write(
                f"tandem train: error: the checkpoint after step {run.step}: {problem}. {newest}{advice}",
                file=sys.stderr,
            )
        return False

    def unreadable(mine: list[str]) -> int:
        """The run's end, on every rank, where a recording could not be read: each rank names its own."""
        for problem in mine:
            print(f"tandem train: error: {problem}", file=sys.stderr, flush=True)
        if lead:
            print(
                f"tandem train: error: a recording could not be read after step {run.step} (the check "
                f"before the run reads headers only); nothing after the newest checkpoint was saved "
                f"({_newest_checkpoint(store)}). Mend the recording and run the same command again (with "
                "--resume where a checkpoint is), or take its line out of the manifest and start a new run",
                file=sys.stderr,
                flush=True,
            )
        return 2

    steps: Iterator = iter(())
    try:
        steps = run.batches(workers, worker_cores)
        while run.epoch < config.epochs and not stopped:
            run.epoch_started = time.perf_counter() - run.epoch_seconds_before
            run.epoch_seconds_before = 0.0  # (a resumed epoch's, once)
            count = run.batch_count(run.epoch)
            bar = tqdm(
                total=count, initial=run.position, desc=f"epoch {run.epoch + 1}/{config.epochs}",
                unit="batch", leave=False, disable=not lead,
            )  # fmt: skip
            while run.position < count:
                if checkpointing.every:
                    due = (run.step + 1) % checkpointing.every == 0
                else:  # rank 0's clock decides; the all-reduce below tells the others
                    due = lead and time.perf_counter() - last_save >= checkpointing.seconds
                batch, size, problems = next(steps)
                step_loss, n_stop, n_save, n_unread = run.step_and_sync(
                    (batch, size), (float(stop.signal is not None), float(due), float(len(problems)))
                )
                if n_unread:  # the same sum on every rank: they all end here, saving nothing of this step
                    bar.close()
                    board.close()
                    return unreadable(problems)
                bar.set_postfix(loss=f"{step_loss:.3f}", lr=f"{run.learning_rate():.3g}")
                board.scalars(run.step, {"train/loss": step_loss, "train/learning_rate": run.learning_rate()})
                bar.update()
                if not math.isfinite(step_loss):  # the same sum on every rank: they all stop here
                    bar.close()
                    board.close()
                    if lead:
                        print(
                            f"tandem train: error: the loss became {step_loss} at step {run.step} (epoch "
                            f"{run.epoch + 1}); nothing after it was saved ({_newest_checkpoint(store)}). "
                            "Lower --lr and start again",
                            file=sys.stderr,
                            flush=True,
                        )
                    return 1
                stopped = stopped or n_stop > 0
                if run.position < count and (n_save or stopped):  # the epoch's end saves anyway
                    not_saved = not save()
                if stopped or not_saved:
                    break
            bar.close()
            if run.position < count:
                break  # stopped mid-epoch, or a checkpoint not written
            loss_sum, count = run.end_epoch()
            train_seconds = time.perf_counter() - run.epoch_started
            try:
                rates, examples = run.evaluate()
            except BadRecordings as e:  # raised on every rank
                board.close()
                return unreadable(e.mine)
            record = {
                "epoch": run.epoch,
                "step": run.step,
                "train_loss": loss_sum / count,
                "test_wer": rates.wer,
                "test_cer": rates.cer,
                "test_accuracy": rates.accuracy,
                "test_words": rates.words,
                "seconds": time.perf_counter() - run.epoch_started,
                "train_seconds": train_seconds,
                "utterances": count,
            }
            run.history.append(record)
            if not math.isfinite(record["train_loss"]):
                if lead:
                    print(
                        f"tandem train: error: the loss became {record['train_loss']} in epoch {run.epoch}",
                        file=sys.stderr,
                    )
                return 1
            if lead:
                print(
                    f"epoch {run.epoch}/{config.epochs}: loss {record['train_loss']:.4f}, "
                    f"test WER {100 * rates.wer:.2f}% CER {100 * rates.cer:.2f}% "
                    f"({rates.word_edits}/{rates.words} words), {record['seconds']:.1f} s"
                    f"  e.g. {examples[0][0]!r} -> {examples[0][1]!r}",
                    flush=True,
                )
            board.epoch(run.step, record, examples)
            not_saved = not save()
            if not_saved:
                break
            # a signal that came during the evaluation stops the run here, after that epoch's checkpoint
            stopped = stopped or group.sum([float(stop.signal is not None)])[0] > 0

        board.close()
        if not_saved:
            return EXIT_NOT_SAVED
        if stopped and run.epoch >= config.epochs and lead:  # in the last epoch's evaluation: nothing is left
            print(
                "tandem train: the stop request came after the last step; finishing the run", file=sys.stderr
            )
        if stopped and run.epoch < config.epochs:
            if lead:
                print(
                    f"tandem train: stopped by a signal after step {run.step} (epoch {run.epoch + 1}, batch "
                    f"{run.position}); wrote {store.path}. Run the same command with --resume to continue.",
                    file=sys.stderr,
                    flush=True,
                )
            return EXIT_STOPPED

        # ru_maxrss is in KiB on Linux; the largest of the ranks'
        (peak_rss,) = group.max([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024])
        if not lead:
            return 0
        written = ["checkpoint.pt"] if saves or _launch_wrote(store.path) else []
        final = run.history[-1] if run.history else {}
        metrics = {
            "task": "asr",
            "test_wer": final.get("test_wer"),
            "test_cer": final.get("test_cer"),
            "test_accuracy": final.get("test_accuracy"),
            "train_loss": final.get("train_loss"),
            "train_seconds": run.seconds_before,
            "epochs": len(run.history),
            "steps": run.step,
            "world_size": group.world,
            "peak_rss_mib": round(peak_rss, 1),
            "device": str(group.device),
            "config": config.to_dict(),
            "history": run.history,
            "tandem_version": tandem.__version__,
            "torch_version": torch.__version__,
        }
        # rank 0 alone, after the last collective: the others have ended
        error = write_run_files(
            out,
            json.dumps(metrics, indent=2),
            lambda path: bool(run.history) and _plot(run.history, path),
            written,
        )
        if error:
            print(error, file=sys.stderr, flush=True)
            return 1
        if board.writer is not None:
            written.append("TensorBoard events")
        wer = (
            f"test WER {100 * final['test_wer']:.2f}%, CER {100 * final['test_cer']:.2f}%"
            if final
            else "no epochs run"
        )
        print(
            f"done: {wer} after {len(run.history)} epochs, {run.seconds_before:.1f} s of training "
            f"({time.perf_counter() - started:.1f} s in this launch); wrote {', '.join(written)} to {out}",
            flush=True,
        )
        return 0
    finally:
        end_workers(steps)
