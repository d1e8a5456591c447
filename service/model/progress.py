"""A one-line stderr progress indicator for model loading."""

from __future__ import annotations

import sys
from typing import TextIO


class Progress:
    """Rewrites one stderr line as work advances; silent when disabled."""

    def __init__(
        self, label: str, total: int, *, enabled: bool, stream: TextIO | None = None
    ) -> None:
        self._label = label
        self._total = max(total, 1)
        self._enabled = enabled
        self._stream = stream if stream is not None else sys.stderr
        self._done = 0
        self._last_pct = -1

    def advance(self, n: int = 1) -> None:
        self._done = min(self._done + n, self._total)
        # Redraw in 5% steps so a non-tty stderr (a log file) gets 21 updates, not thousands.
        pct = self._done * 100 // self._total // 5 * 5
        if self._enabled and pct != self._last_pct:
            self._last_pct = pct
            filled = pct // 5
            bar = "#" * filled + "." * (20 - filled)
            self._stream.write(f"\r{self._label} [{bar}] {pct:3d}%")
            self._stream.flush()

    def close(self) -> None:
        if self._enabled:
            self._stream.write("\n")
            self._stream.flush()
