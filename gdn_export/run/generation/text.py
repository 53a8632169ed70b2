"""Tokens to text as they come: incremental detokenization and stop strings.

``Detokenizer`` turns a growing list of token ids into text pieces whose concatenation is the decoded text, never
emitting a piece that ends inside a UTF-8 character (a byte-level token may hold part of one: the decoder then ends
with U+FFFD, and the piece waits for the next token). It decodes a short window (the ids since the last complete
piece, plus the ones before as context, as vLLM and transformers' ``TextStreamer`` do) rather than the whole text.
Special tokens are skipped (OpenAI's and vLLM's default).

``StopStrings`` holds back the text that may be the start of a stop string and cuts the text before the first
stop string found, as OpenAI does (the stop string is not returned).
"""

from __future__ import annotations

import functools

REPLACEMENT = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int] | tuple[int, ...] = (), context: int = 4) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-context:]) if context else []
        # the window: ids[prefix:read] were emitted already (decoded as context), ids[read:] not yet
        self.prefix = 0
        self.read = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """The new text that ``token_id`` completes ("" while a character is incomplete)."""
        self.ids.append(token_id)
        return self._step(final=False)

    def flush(self) -> str:
        """What is left at the end of the sequence (an incomplete character stays a U+FFFD)."""
        return self._step(final=True)

    def _step(self, final: bool) -> str:
        if self.read == len(self.ids):
            return ""
        before = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        if not final and (len(text) <= len(before) or text.endswith(REPLACEMENT)):
            return ""  # an incomplete character, or no text yet (a skipped special token): the window grows
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]


class StopStrings:
    """Text accumulated, held back where it may begin a stop string, cut before the first stop string."""

    def __init__(self, stops: list[str] | tuple[str, ...]) -> None:
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""  # everything decoded so far (up to the cut once a stop string matched)
        self.emitted = 0
        self.matched: str | None = None

    def add(self, piece: str) -> str:
        """Append ``piece``; return the text now safe to emit ("" while it may be a stop string's start). After a
        match (``matched`` set) the text is cut before the stop string and nothing more is taken."""
        if self.matched is not None:
            return ""
        start = max(0, len(self.text) - self.longest + 1)
        self.text += piece
        if not self.stops:
            return self._emit(len(self.text))
        found = None
        for stop in self.stops:
            at = self.text.find(stop, start)
            if at >= 0 and (found is None or at < found[0]):
                found = (at, stop)
        if found is not None:
            self.text, self.matched = self.text[:found[0]], found[1]
            return self._emit(len(self.text))
        return self._emit(len(self.text) - self._held())

    def flush(self) -> str:
        return self._emit(len(self.text))

    def _held(self) -> int:
        """The length of the longest end of the text that begins a stop string (a proper prefix of one). Only the
        prefixes that end with the text's last character are tried (``_ends``): at most the stop strings' total
        length of comparisons a token, and in practice a handful."""
        if not self.text:
            return 0
        for stop, size in self._ends.get(self.text[-1], ()):  # longest first: the first match is the answer
            if size <= len(self.text) and self.text.endswith(stop[:size]):
                return size
        return 0

    @functools.cached_property
    def _ends(self) -> dict[str, list[tuple[str, int]]]:
        """For each character, the (stop string, prefix length) whose proper prefix ends with it, longest first."""
        ends: dict[str, list[tuple[str, int]]] = {}
        for stop in self.stops:
            for size in range(len(stop) - 1, 0, -1):
                ends.setdefault(stop[size - 1], []).append((stop, size))
        for entries in ends.values():
            entries.sort(key=lambda entry: -entry[1])
        return ends

    def _emit(self, until: int) -> str:
        if until <= self.emitted:
            return ""
        piece, self.emitted = self.text[self.emitted:until], until
        return piece
