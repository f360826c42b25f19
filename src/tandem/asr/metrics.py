"""Word and character error rates: edit distance to the reference over the reference's length."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["edit_distance", "ErrorRates", "error_rates"]


def edit_distance(reference: Sequence, hypothesis: Sequence) -> int:
    """Levenshtein distance: the fewest substitutions, deletions and insertions that turn ``reference``
    into ``hypothesis`` (sequences of words or of characters)."""
    previous = list(range(len(hypothesis) + 1))
    for i, r in enumerate(reference, 1):
        current = [i]
        for j, h in enumerate(hypothesis, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (r != h)))
        previous = current
    return previous[-1]


@dataclass(frozen=True)
class ErrorRates:
    """Summed over a test set: word and character edits and reference lengths, and exact utterances."""

    word_edits: int
    words: int
    char_edits: int
    chars: int
    exact: int
    utterances: int

    @property
    def wer(self) -> float:
        return self.word_edits / max(self.words, 1)

    @property
    def cer(self) -> float:
        return self.char_edits / max(self.chars, 1)

    @property
    def accuracy(self) -> float:
        """Utterances recognised without any error."""
        return self.exact / max(self.utterances, 1)

    def __add__(self, other: ErrorRates) -> ErrorRates:
        return ErrorRates(*(a + b for a, b in zip(self.as_tuple(), other.as_tuple())))

    def as_tuple(self) -> tuple[int, ...]:
        return (self.word_edits, self.words, self.char_edits, self.chars, self.exact, self.utterances)


def error_rates(references: Sequence[str], hypotheses: Sequence[str]) -> ErrorRates:
    """Error counts of ``hypotheses`` against ``references`` (whitespace-separated words; characters
    include the single spaces between words).

    Example::

        >>> r = error_rates(["four seven two"], ["four seven"])
        >>> r.wer, r.words
        (0.3333333333333333, 3)
    """
    if len(references) != len(hypotheses):
        raise ValueError(
            f"error_rates: expected as many hypotheses as references ({len(references)}), "
            f"got {len(hypotheses)}"
        )
    counts = [0] * 6
    for ref, hyp in zip(references, hypotheses):
        ref_words, hyp_words = ref.split(), hyp.split()
        counts[0] += edit_distance(ref_words, hyp_words)
        counts[1] += len(ref_words)
        counts[2] += edit_distance(" ".join(ref_words), " ".join(hyp_words))
        counts[3] += len(" ".join(ref_words))
        counts[4] += ref_words == hyp_words
        counts[5] += 1
    return ErrorRates(*counts)
