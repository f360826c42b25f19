"""Characters and label ids: the CTC alphabet (blank, space, apostrophe, a-z by default)."""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

__all__ = ["BLANK", "Alphabet", "ENGLISH"]

BLANK = "_"  # how the blank is shown; it is never a character of a transcript


class Alphabet:
    """The output classes of a CTC model: id 0 is the blank, ids 1.. are ``characters`` in order.

    Transcripts are lower-cased on the way in; a character outside the alphabet is an error naming it.

    Example::

        >>> abc = Alphabet(" 'abcdefghijklmnopqrstuvwxyz")
        >>> abc.encode("Four two")
        tensor([ 8, 17, 23, 20,  1, 22, 25, 17])
        >>> abc.decode([8, 17, 23, 20])
        'four'
    """

    def __init__(self, characters: str) -> None:
        if not characters or len(set(characters)) != len(characters) or BLANK in characters:
            raise ValueError(
                f"Alphabet: expected distinct characters without {BLANK!r} (the blank), got {characters!r}"
            )
        self.characters = characters
        self._ids = {c: i + 1 for i, c in enumerate(characters)}

    def __len__(self) -> int:
        """Classes, the blank included."""
        return len(self.characters) + 1

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Alphabet) and other.characters == self.characters

    def __hash__(self) -> int:
        return hash(self.characters)

    def __repr__(self) -> str:
        return f"Alphabet({self.characters!r})"

    def normalize(self, text: str) -> str:
        """Lower-cased, in Unicode's composed form (NFC: "é" one character, however a tool saved it),
        whitespace runs as one space, no leading or trailing space."""
        return " ".join(unicodedata.normalize("NFC", text.lower()).split())

    def unknown(self, text: str) -> list[str]:
        """The characters of ``normalize(text)`` that are not in the alphabet, in order of appearance."""
        seen: dict[str, None] = {}
        for c in self.normalize(text):
            if c not in self._ids:
                seen[c] = None
        return list(seen)

    def encode(self, text: str) -> Tensor:
        """Label ids ``[len]`` int64 of ``normalize(text)``."""
        text = self.normalize(text)
        bad = self.unknown(text)
        if bad:
            raise ValueError(
                f"Alphabet: characters {''.join(bad)!r} of {text!r} are not in {self.characters!r}"
            )
        return torch.tensor([self._ids[c] for c in text], dtype=torch.int64)

    def decode(self, ids: Iterable[int] | Tensor) -> str:
        """The characters of label ids (the blank, id 0, is skipped)."""
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        return "".join(self.characters[i - 1] for i in ids if i)

    @classmethod
    def widened(cls, base: Alphabet, extra: Sequence[str]) -> Alphabet:
        """``base`` with the characters of ``extra`` it lacks appended (in order), in Unicode's composed form
        (NFC), as transcripts are (:meth:`normalize`)."""
        extra = unicodedata.normalize("NFC", "".join(extra))
        more = "".join(dict.fromkeys(c for c in extra if c not in base._ids and c != BLANK))
        return cls(base.characters + more)


ENGLISH = Alphabet(" 'abcdefghijklmnopqrstuvwxyz")
