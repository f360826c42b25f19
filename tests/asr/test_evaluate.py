"""A run's evaluation: the test set is featurised once and kept (it has no augmentation), unless its
features are larger than the budget; either way every evaluation scores the same utterances alike."""

from __future__ import annotations

import pytest
import torch

import tandem.asr.training as training
from tandem.asr.corpus import load_spoken_digits
from tandem.asr.distributed import Group
from tandem.asr.generator import ConnectedDigits, split_recordings
from tandem.asr.model import ModelConfig
from tandem.asr.training import DataSets, Run, TrainConfig


class _Counting(ConnectedDigits):
    renders = 0

    def render(self, utterance):
        type(self).renders += 1
        return super().render(utterance)


@pytest.fixture
def run(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    rec = load_spoken_digits()
    train_ids, test_ids = split_recordings(rec)
    _Counting.renders = 0
    data = DataSets(ConnectedDigits(rec, train_ids[:64]), _Counting(rec, test_ids[:40]))
    config = TrainConfig(model=ModelConfig(hidden=16, layers=1, conv_channels=4), augment=False)
    return Run(config, Group(torch.device("cpu"), 10), data)


def _evaluate_three_times(run):
    first = [run.evaluate(batch_size=8) for _ in range(2)]
    batch, size, unread = next(run.batches())
    assert unread == []
    run.train_step(batch, size)  # the weights change: the kept features must still serve
    return first, run.evaluate(batch_size=8)


def test_the_test_set_is_featurised_once(run, monkeypatch):
    utterances = len(run.test_plan)
    (a, b), after = _evaluate_three_times(run)
    assert _Counting.renders == utterances
    assert a == b
    kept = list(run._test_batches(8, []))
    assert _Counting.renders == utterances

    # nothing kept: every evaluation reads and featurises again, and gets what was kept
    monkeypatch.setattr(training, "TEST_CACHE_BYTES", 0)
    fresh = Run(run.config, run.group, DataSets(run.train_set, run.test_set))
    _Counting.renders = 0
    (c, d), after_fresh = _evaluate_three_times(fresh)
    assert _Counting.renders == 3 * utterances
    assert a == c == d and after == after_fresh
    made = list(fresh._test_batches(8, []))
    assert len(made) == len(kept) > 1
    for x, y in zip(kept, made):
        assert x.transcripts == y.transcripts
        for name in ("features", "frames", "targets", "target_lengths"):
            assert torch.equal(getattr(x, name), getattr(y, name)), name
