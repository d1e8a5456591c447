"""Incremental detokenizer: UTF-8-safe text deltas with stop-string trimming.

Tokens of a byte-level BPE vocabulary are byte strings that may end inside a multi-byte
character. The detokenizer feeds each token's raw bytes into an incremental UTF-8 decoder,
which returns only complete characters and keeps the partial tail for the next token.
Invalid bytes decode to U+FFFD, as the tokenizer's own full decode does, so the deltas
concatenate exactly to ``tokenizer.decode(output_ids, skip_special_tokens=True)``
(or to that text cut before the first matched stop string).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable

from service.engine.stop import StopMatcher


class IncrementalDetokenizer:
    """Turns sampled token ids into text deltas for one request."""

    __slots__ = (
        "_decoder",
        "_emitted",
        "_skip",
        "_stop",
        "_text",
        "_token_bytes",
        "stopped",
    )

    def __init__(
        self,
        token_bytes: Callable[[int], bytes],
        special_ids: frozenset[int],
        stop: StopMatcher,
    ) -> None:
        self._token_bytes = token_bytes
        self._skip = special_ids
        self._stop = stop
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = ""
        self._emitted = 0
        self.stopped = False  # set when a stop string matched; the request must finish

    @property
    def text(self) -> str:
        """All decoded text so far, including held-back text not yet emitted."""
        return self._text

    def push(self, token_id: int, match_stops: bool = True) -> str:
        """Add one token; return the text that is now safe to stream (may be empty).

        With ``match_stops`` false (before ``min_tokens``), stop strings are not searched and
        no text is held back for them.
        """
        if self.stopped:
            raise RuntimeError("detokenizer already stopped")
        prev_len = len(self._text)
        if token_id not in self._skip:
            self._text += self._decoder.decode(self._token_bytes(token_id))
        if not match_stops:
            return self._emit(len(self._text))
        match = self._stop.scan(self._text, prev_len, self._emitted)
        if match.stopped:
            self.stopped = True
            self._text = self._text[: match.safe_end]
        return self._emit(match.safe_end)

    def flush(self) -> str:
        """Generation ended (not by a stop string): release held text and any partial char."""
        if not self.stopped:
            self._text += self._decoder.decode(b"", final=True)
        return self._emit(len(self._text))

    def _emit(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        out = self._text[self._emitted : end]
        self._emitted = end
        return out
