"""``make verify``: the isolation and reliability suite at full size, as one table.

    python -m tests.verify_report            # full sizes (KVFENCE_VERIFY=full)
    python -m tests.verify_report --short    # the short sizes `make test` runs
    python -m tests.verify_report -- -k soak # extra pytest arguments after --

Prints one table of every figure (pass/fail against its expected value), writes
``verify.json`` and the page ``verify.md`` (``docs/`` for a full run; a short run writes them
only where ``--results`` says), and exits non-zero if any check or test fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITES = ("tests/isolation", "tests/reliability")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.verify_report")
    parser.add_argument("--short", action="store_true", help="run the short sizes")
    parser.add_argument(
        "--results",
        default=None,
        help="where verify.json and verify.md go (default: docs/ for a full run, a temporary "
        "directory for --short)",
    )
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    os.environ["KVFENCE_VERIFY"] = "short" if args.short else "full"
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import pytest

    from tests.verify.plugin import VerifyReport

    if args.results is not None:
        results = Path(args.results)
    elif args.short:  # short sizes must not overwrite the full report the docs link to
        results = Path(tempfile.mkdtemp(prefix="kvfence-verify-"))
    else:
        results = ROOT / "docs"
    report = VerifyReport(results_dir=results)
    code = pytest.main(
        ["-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT), *SUITES, *args.pytest_args],
        plugins=[report],
    )
    return 0 if code == 0 and report.passed() else 1


if __name__ == "__main__":
    sys.exit(main())
