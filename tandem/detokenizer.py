"""Incremental detokenization and stop strings.

Decoding only the newest tokens can split a multi-byte character or a word piece, so text is
emitted from a sliding window (`prefix_offset`..`read_offset`) and held back while it ends in an
incomplete character (U+FFFD). Stop strings are searched only in the newly extended tail.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.include_stop = include_stop  # the text keeps the stop string it ends on
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        # characters a stop string may reach back into text already seen
        self._reach = max(map(len, self.stop), default=1) - 1
        self.tokens = list(prompt_token_ids[-6:])  # a little context for leading-space rules
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""
        self.emitted = 0  # characters of text already handed out by pop_text
        self.stop_string: str | None = None

    def add(self, token_ids: Sequence[int]) -> None:
        """Append tokens; text ends before a stop string if one appears (see `stop_string`)."""
        if self.stop_string is not None:
            return
        self.tokens.extend(token_ids)
        skip = self.skip_special_tokens
        prefix = self.tokenizer.decode(
            self.tokens[self.prefix_offset : self.read_offset], skip_special_tokens=skip
        )
        full = self.tokenizer.decode(self.tokens[self.prefix_offset :], skip_special_tokens=skip)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return  # an incomplete character: wait for the next token
        before = len(self.text)
        self.text += full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        if self.stop:
            # A stop string may straddle the previous text and the new piece.
            start = max(0, before - self._reach)
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                index, self.stop_string = min(hits)
                self.text = self.text[: index + len(self.stop_string) * self.include_stop]

    def pop_text(self, finished: bool) -> str:
        """Text not yet handed out. While running, the last len(longest stop) - 1 characters are
        held back: they may turn out to begin a stop string."""
        end = len(self.text)
        if not finished and self.stop_string is None and self.stop:
            end = max(self.emitted, end - self._reach)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
