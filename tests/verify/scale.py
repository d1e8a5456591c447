"""One code path, two sizes: ``KVFENCE_VERIFY=full`` (``make verify``) or short (``make test``)."""

from __future__ import annotations

import os
from typing import TypeVar

T = TypeVar("T")

ENV = "KVFENCE_VERIFY"


def is_full() -> bool:
    return os.environ.get(ENV, "").strip().lower() == "full"


def size(short: T, full: T) -> T:
    """``full`` under ``KVFENCE_VERIFY=full``, else ``short``."""
    return full if is_full() else short


def mode() -> str:
    return "full" if is_full() else "short"
