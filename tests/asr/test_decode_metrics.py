"""Greedy CTC decoding on hand-built outputs, and WER/CER against jiwer (which we did not write)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tandem.asr.decode import greedy_decode
from tandem.asr.metrics import edit_distance, error_rates
from tandem.asr.text import ENGLISH, Alphabet

jiwer = pytest.importorskip("jiwer")


def _scores(path: str) -> torch.Tensor:
    """Per-frame one-hot scores ``[T, K]`` of a path written with ``_`` for the blank."""
    ids = [0 if c == "_" else ENGLISH.characters.index(c) + 1 for c in path]
    return F.one_hot(torch.tensor(ids), len(ENGLISH)).float()


@pytest.mark.parametrize(
    "path, text",
    [
        ("__oo_nn_e__", "one"),
        ("thhr_e_e", "three"),  # a blank between two e's keeps both
        ("thhreee", "thre"),  # without one they collapse
        ("s_ix  _t_wo", "six two"),
        ("________", ""),
        ("e", "e"),
    ],
)
def test_greedy_decode_hand_built(path, text):
    assert greedy_decode(_scores(path)[:, None], torch.tensor([len(path)]), ENGLISH) == [text]


def test_greedy_decode_batch_ignores_frames_past_each_length():
    a, b = _scores("_one___"), _scores("tw_o_zz")  # b's last two frames are padding
    assert greedy_decode(torch.stack([a, b], 1), torch.tensor([7, 5]), ENGLISH) == ["one", "two"]
    with pytest.raises(ValueError, match=r"expected log_probs \[T, B, 29\]"):
        greedy_decode(torch.zeros(3, 1, 5), torch.tensor([3]), ENGLISH)


def test_alphabet():
    assert len(ENGLISH) == 29 and ENGLISH.decode(ENGLISH.encode("Don't  STOP")) == "don't stop"
    with pytest.raises(ValueError, match="characters '1é' of"):
        ENGLISH.encode("take 1 café")
    assert ENGLISH.unknown("take 1 café") == ["1", "é"]
    wide = Alphabet.widened(ENGLISH, ["café 1"])
    assert wide.characters == ENGLISH.characters + "é1" and wide.decode(wide.encode("café 1")) == "café 1"
    with pytest.raises(ValueError, match="distinct characters"):
        Alphabet("aab")


def _random_text(rng: random.Random, words: int) -> str:
    vocab = ["one", "two", "three", "oh", "seven", "eight", "nine", "on", "to", "tree", "", "x"]
    return " ".join(w for w in (rng.choice(vocab) for _ in range(words)) if w)


def test_error_rates_equal_jiwer_on_random_strings():
    rng = random.Random(0)
    refs = [_random_text(rng, rng.randint(1, 8)) or "one" for _ in range(300)]
    hyps = [_random_text(rng, rng.randint(0, 9)) for _ in range(300)]
    ours = error_rates(refs, hyps)
    assert ours.wer == pytest.approx(jiwer.wer(refs, hyps), abs=1e-12)
    assert ours.cer == pytest.approx(jiwer.cer(refs, hyps), abs=1e-12)
    assert ours.utterances == 300 and ours.words == sum(len(r.split()) for r in refs)


def test_error_rates_count_exact_utterances_and_add():
    a = error_rates(["four seven two", "one"], ["four seven two", "won"])
    assert (a.word_edits, a.words, a.exact, a.accuracy) == (1, 4, 1, 0.5)
    b = error_rates(["nine"], [""])
    total = a + b
    assert total.words == 5 and total.word_edits == 2 and total.chars == a.chars + 4
    with pytest.raises(ValueError, match="as many hypotheses"):
        error_rates(["a"], [])


def test_error_rates_read_words_between_any_whitespace():
    """Greedy CTC output can start or end on a space, or hold two: the words and the single spaces between
    them are what count, so an utterance with the right words is right, and the characters' reference
    length is that of the single-spaced words."""
    refs, hyps = [" four  seven two ", "one", "nine\teight"], ["four seven two", " one ", "nine  eigh "]
    ours = error_rates(refs, hyps)
    tidy = error_rates([" ".join(r.split()) for r in refs], [" ".join(h.split()) for h in hyps])
    assert ours == tidy and ours.exact == 2 and ours.chars == len("four seven two") + 3 + len("nine eight")
    assert ours.char_edits == 1 and ours.word_edits == 1


def test_edit_distance():
    assert (
        edit_distance("kitten", "sitting") == 3
        and edit_distance([], ["a"]) == 1
        and edit_distance("", "") == 0
    )
