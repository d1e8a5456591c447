"""Writing, or checking, one generated page under ``docs/`` (``make docs``; ``--check``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def check_flag(prog: str, argv: list[str] | None) -> bool:
    """Whether ``python -m PROG`` was asked only to check (``--check``)."""
    parser = argparse.ArgumentParser(prog=f"python -m {prog}")
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    return bool(parser.parse_args(argv).check)


def write_or_check(doc: Path, text: str, check: bool, remedy: str, note: str = "") -> int:
    """Write ``text`` to ``doc``, or with ``check`` exit 1 (naming ``remedy``) when the
    committed page differs from it."""
    if check:
        if not doc.exists() or doc.read_text() != text:
            print(f"kvfence: {doc.relative_to(ROOT)} is stale: run {remedy}", file=sys.stderr)
            return 1
        return 0
    doc.write_text(text)
    print(f"wrote {doc.relative_to(ROOT)}{note}")
    return 0
