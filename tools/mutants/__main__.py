"""``make mutants``: switch off each stated guarantee and check that a test notices.

    python -m tools.mutants                 # every mutant, after an unmutated baseline
    python -m tools.mutants -k scrub,log    # only mutants whose name contains scrub or log
    python -m tools.mutants --list          # the catalogue, nothing run
    python -m tools.mutants --markdown out.md

Prints one row per mutant (killed, and by which test, or SURVIVED / STALE / BROKEN) and exits
non-zero unless every selected mutant is killed. The catalogue is ``tools/mutants/catalog``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from tools.mutants.catalog import ALL
from tools.mutants.run import Row, run_all


def render(rows: Sequence[Row]) -> list[str]:
    header = ("mutant", "guarantee switched off", "result", "killed by")
    body = [(r.mutant.name, r.mutant.guarantee, r.result, r.by) for r in rows]
    widths = [min(60, max(len(h), *(len(b[i]) for b in body))) for i, h in enumerate(header)]
    return ["  ".join(c[:w].ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
            for cells in (header, tuple("-" * w for w in widths), *body)]


def markdown(rows: Sequence[Row]) -> str:
    lines = ["| mutant | guarantee switched off | result | killed by |", "|---|---|---|---|"]
    for r in rows:
        cells = (f"`{r.mutant.name}`", r.mutant.guarantee, r.result,
                 f"`{r.by}`" if r.by else "")
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.mutants")
    parser.add_argument("-k", dest="match", default="",
                        help="run mutants whose name contains this (comma: any of several)")
    parser.add_argument("--list", action="store_true", help="print the catalogue and exit")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant")
    parser.add_argument("--markdown", type=Path, help="also write the table as markdown here")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copy")
    args = parser.parse_args(argv)
    names = [m.name for m in ALL]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        parser.error(f"duplicate mutant names: {sorted(duplicates)}")
    wanted = args.match.split(",")
    chosen = [m for m in ALL if any(w in m.name for w in wanted)]
    if not chosen:
        parser.error(f"no mutant name contains {args.match!r}")
    if args.list:
        for m in chosen:
            print(f"{m.name:<34} {m.guarantee}\n{'':<34} tests: {' '.join(m.tests)}")
        return 0
    rows = run_all(chosen, timeout=args.timeout, with_baseline=not args.no_baseline,
                   keep=args.keep)
    print()
    for line in render(rows):
        print(line)
    killed = sum(r.killed for r in rows)
    print(f"\nmutants: {killed}/{len(rows)} killed"
          + ("" if killed == len(rows) else f"; NOT killed: {[r.mutant.name for r in rows if not r.killed]}"))
    if args.markdown:
        args.markdown.write_text(markdown(rows), encoding="utf-8")
    return 0 if killed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
