"""No tracked text speaks of how the project was developed, only of what it is.

Words like "stop 31's code", "this release" or "issue 12" mean nothing to a user or a new
maintainer: there are no stops or releases to look up. Each pattern below names one such
phrase; ``_ALLOWED`` keeps the product's own words that look alike ("stop strings"), each as
a precise pattern.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Development-history phrases, matched case-insensitively.
HISTORY = (
    r"\bstops? \d+\b",             # "stop 31", "stops 33 and 34"
    r"\bthis stop\b",
    r"\b(?:next|last|previous) stop\b",
    r"\bissues? ?[-#]? ?\d+\b",     # "issue 12", "issue-13", "issue #4"
    r"\bissue-size\b",
    r"\bfindings? \d+\b",          # "finding 7 of issue 12"
    r"\b(?:this|previous|next|last) release\b",
    r"\brelease before\b",
    r"\b(?:earlier|later) today\b",
    r"\byesterday\b",
    r"\bbefore this (?:rule|change|fix|commit|stop)\b",
    r"\bthis (?:pr|commit|patch)\b",
    r"\bturn[- ]\d+\b",
)
PATTERN = re.compile("|".join(f"(?:{p})" for p in HISTORY), re.IGNORECASE)

#: Product words that look like history, each allowed only in exactly this form.
_ALLOWED = re.compile(
    r"\bstop (?:strings?|token ids?|sequences?)\b",
    re.IGNORECASE,
)

#: Files that must quote the phrases to test for them.
_SKIP = {"tests/test_wording.py"}
_TEXT = (".py", ".md", ".toml", ".txt", ".yaml", ".yml", ".cfg", ".c", ".h", ".sh", ".proto",
         ".json", ".ini", "")


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    return [p for p in out if p not in _SKIP and Path(p).suffix in _TEXT
            and (ROOT / p).is_file()]


def hits(text: str) -> list[str]:
    """Each development-history phrase in ``text`` that no allowed product word covers."""
    found = []
    for m in PATTERN.finditer(text):
        line_start = text.rfind("\n", 0, m.start()) + 1
        line_end = text.find("\n", m.end())
        line = text[line_start: len(text) if line_end < 0 else line_end]
        allowed = any(a.start() <= m.start() - line_start < a.end()
                      for a in _ALLOWED.finditer(line))
        if not allowed:
            found.append(m.group(0))
    return found


def test_no_tracked_file_speaks_of_the_projects_history() -> None:
    files = _tracked()
    assert "README.md" in files and "service/serve/commands.py" in files
    bad = []
    for rel in files:
        try:
            text = (ROOT / rel).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            bad += [f"{rel}:{lineno}: {h!r}" for h in hits(line)]
    assert bad == []


@pytest.mark.parametrize("text", [
    "with stop 31's code", "measured in this stop", "stops 33 and 34", "Fair compute (issue 12)",
    "all issue-13 targets pass", "finding 7 of issue 12", "before this release",
    "105-132 earlier today", "0.058 s before this rule", "the issue-size hog",
])
def test_history_phrases_are_caught(text: str) -> None:
    assert hits(text) != []


@pytest.mark.parametrize("text", [
    "stop strings (repeatable)", "at most 64 stop token ids", "--stop", "stop_token_ids",
    "the engine stops", "stops at a blank line", "ggml-org/llama.cpp#20824",
])
def test_product_words_are_not_history(text: str) -> None:
    assert hits(text) == []
