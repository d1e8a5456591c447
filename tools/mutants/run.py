"""Run every mutant in a scratch copy of the tree and report which test killed it.

The scratch copy holds the tracked and untracked (not ignored) files, so uncommitted work is
tested as it is. Each mutant's edits are written into the copy, its tests run there, and the
original text is put back. Bytecode is never written, so a restored file can never be shadowed
by a stale ``.pyc`` of its mutated version. Before any mutant, the union of the selections runs
once unmutated: a test that fails anyway kills nothing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvcache.native_build import FLAGS, ISAS
from tools.mutants.mutant import HARDWARE, Mutant, StaleAnchor, mutated_sources

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kvcache", "service", "clients", "protos", "tests")


@dataclass(frozen=True, slots=True)
class RunResult:
    code: int  # pytest's exit code; -1 on timeout
    failed: tuple[str, ...]  # failing test ids, first failure first
    seconds: float
    why: str = ""  # the first failure's message
    ran: int = -1  # tests that ran (not skipped); -1 when unknown
    skipped: str = ""  # the first skip's reason


@dataclass(frozen=True, slots=True)
class Row:
    mutant: Mutant
    result: str  # killed | timeout | SURVIVED | not run | STALE | BROKEN
    by: str
    seconds: float
    why: str = ""

    @property
    def killed(self) -> bool:
        return self.result in ("killed", "timeout")

    @property
    def passed(self) -> bool:
        """Killed, or not run: every guarding test skips on this machine (code it does not
        run, such as a tile-unit kernel on a CPU without one): neither killed nor survived."""
        return self.killed or self.result == "not run"


def scratch_copy(root: Path, dest: Path) -> None:
    """Copy the files git tracks or would track (ignored files, .venv and caches stay out)."""
    listing = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=root, check=True, capture_output=True,
    ).stdout.decode()
    for rel in filter(None, listing.split("\0")):
        src = root / rel
        if not src.is_file():  # deleted in the work tree, not yet committed
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


def scratch_env(scratch: Path, tier: str = "native") -> dict[str, str]:
    """The tests' environment: the scratch copy's packages, and ``tier``'s kernel build."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(scratch)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["KVFENCE_KERNEL_ISA"] = tier
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def in_kernels(m: Mutant) -> bool:
    """Whether ``m`` edits the C kernels, the code that differs from one tier's build to
    another's (the Python around them runs alike on every tier)."""
    return any(e.path.endswith((".c", ".h")) for e in m.edits)


def _units(scratch: Path, m: Mutant) -> list[Path]:
    """The translation units ``m``'s edits reach: an edited ``.c`` file, or every ``.c``
    file beside an edited header (each kernel folder builds one translation unit)."""
    units: set[Path] = set()
    for e in m.edits:
        path = scratch / e.path
        if path.suffix == ".c":
            units.add(path)
        elif path.suffix == ".h":
            units.update(path.parent.glob("*.c"))
    return sorted(units)


def assembly(units: Sequence[Path], tier: str) -> list[str]:
    """The assembly ``tier``'s build makes of ``units`` (the kernels' own flags)."""
    compiler = os.environ.get("CC", "cc")
    flags = [f for f in FLAGS if f != "-shared"]
    out = []
    for unit in units:
        done = subprocess.run(
            [compiler, *flags, f"-march={ISAS[tier]}", "-S", str(unit), "-o", "-"],
            cwd=unit.parent, capture_output=True, text=True, timeout=300, check=False,
        )
        # a mutant that does not compile changes the build: its tests fail to load it
        out.append(done.stdout if done.returncode == 0 else f"error {done.returncode}")
    return out


def check_imports_from(scratch: Path, env: dict[str, str]) -> None:
    """Fail loudly unless the scratch copy's packages shadow the editable install."""
    code = "import sys, importlib\n" + "".join(
        f"print(importlib.import_module({p!r}).__file__)\n" for p in PACKAGES
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=scratch, env=env, check=True,
        capture_output=True, text=True,
    ).stdout.split()
    outside = [f for f in out if not Path(f).resolve().is_relative_to(scratch.resolve())]
    if outside:
        raise SystemExit(f"mutants: imports resolve outside the scratch copy: {outside}")


def run_pytest(
    scratch: Path, selection: Sequence[str], env: dict[str, str], timeout: float, stop_first: bool
) -> RunResult:
    junit = scratch / ".mutant-junit.xml"
    junit.unlink(missing_ok=True)
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
            f"--junitxml={junit}", *(["-x"] if stop_first else []), *selection]
    started = time.monotonic()
    proc = subprocess.Popen(args, cwd=scratch, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return RunResult(-1, (), time.monotonic() - started)
    seconds = time.monotonic() - started
    failures = _failures(junit) if junit.exists() else []
    failed = tuple(test for test, _ in failures)
    if proc.returncode not in (0, 1) or (proc.returncode == 1 and not failed):
        tail = "\n".join(output.splitlines()[-15:])
        return RunResult(proc.returncode, (f"pytest exit {proc.returncode}: {tail}",), seconds)
    ran, skipped = _ran(junit) if junit.exists() else (-1, "")
    return RunResult(proc.returncode, failed, seconds, failures[0][1] if failures else "",
                     ran, skipped)


def _ran(junit: Path) -> tuple[int, str]:
    """How many test cases ran (were not skipped), and the first skip's reason."""
    ran, reason = 0, ""
    for case in ET.parse(junit).getroot().iter("testcase"):
        skip = case.find("skipped")
        if skip is None:
            ran += 1
        elif not reason:
            reason = _reason(skip.get("message") or "")
    return ran, reason


def _failures(junit: Path) -> list[tuple[str, str]]:
    """(test id, first line of its failure message) for each failed or errored test."""
    out: list[tuple[str, str]] = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        bad = case.find("failure")
        bad = bad if bad is not None else case.find("error")
        if bad is not None:
            module = case.get("classname", "").rsplit(".", 1)[-1]
            out.append((f"{module}::{case.get('name', '')}", _reason(bad.get("message") or "")))
    return out


def _reason(message: str) -> str:
    """The failure's first line, or the verify check that failed (``assert record(name, ...)``)."""
    lines = message.strip().splitlines()
    first = lines[0] if lines else ""
    for line in lines:
        _, found, call = line.partition("Recorder object at ")
        if found:
            first = "check failed: " + call.split("(", 1)[-1].split(", ", 1)[0]
            break
    return "".join(c if c.isprintable() else "?" for c in first)


def machine_has(scratch: Path, needs: str, env: dict[str, str]) -> bool:
    """Whether this machine's kernels, built from the scratch copy, have ``needs``."""
    code = f"import sys; sys.exit(0 if {HARDWARE[needs]} else 1)"
    done = subprocess.run([sys.executable, "-c", code], cwd=scratch, env=env,
                          capture_output=True, check=False)
    return done.returncode == 0


def run_mutant(
    scratch: Path, m: Mutant, env: dict[str, str], timeout: float, tier: str = "native"
) -> Row:
    if m.needs and not machine_has(scratch, m.needs, env):
        return Row(m, "not run", "", 0.0, f"this machine's kernels have no {m.needs}")
    try:
        sources = mutated_sources(scratch, m)
    except StaleAnchor as err:
        return Row(m, "STALE", str(err), 0.0)
    originals = {path: path.read_text(encoding="utf-8") for path in sources}
    units = _units(scratch, m) if in_kernels(m) else []
    before = assembly(units, tier)
    try:
        for path, text in sources.items():
            path.write_text(text, encoding="utf-8")
        if units and assembly(units, tier) == before:
            return Row(m, "not run", "", 0.0, f"the {tier} build compiles it to the same code")
        result = run_pytest(scratch, m.tests, env, timeout, stop_first=True)
    finally:
        for path, text in originals.items():
            path.write_text(text, encoding="utf-8")
    if result.code == -1:
        return Row(m, "timeout", f"no result in {timeout:.0f} s", result.seconds)
    if result.code == 0 and result.ran == 0:
        return Row(m, "not run", "", result.seconds, f"its tests skip here: {result.skipped}")
    if result.code == 0:
        return Row(m, "SURVIVED", "", result.seconds)
    if result.code == 1:
        return Row(m, "killed", result.failed[0], result.seconds, result.why)
    return Row(m, "BROKEN", result.failed[0] if result.failed else "", result.seconds)


def baseline(scratch: Path, mutants: Iterable[Mutant], env: dict[str, str], timeout: float) -> None:
    selection = sorted({t for m in mutants for t in m.tests})
    result = run_pytest(scratch, selection, env, timeout, stop_first=False)
    if result.code != 0:
        raise SystemExit("mutants: the guarding tests fail without any mutant:\n  "
                         + "\n  ".join(result.failed or ("timeout",)))
    print(f"baseline: {len(selection)} test selections pass unmutated ({result.seconds:.0f} s)",
          flush=True)


def run_all(
    mutants: Sequence[Mutant], *, timeout: float, with_baseline: bool, keep: bool,
    tiers: Sequence[str] = ("native",),
) -> dict[str, list[Row]]:
    """Rows per tier: every mutant on the first tier's build, and the kernel mutants
    (``in_kernels``) again on each further tier's build."""
    scratch = Path(tempfile.mkdtemp(prefix="kvfence-mutants-"))
    try:
        scratch_copy(ROOT, scratch)
        out: dict[str, list[Row]] = {}
        for i, tier in enumerate(tiers):
            chosen = list(mutants) if i == 0 else [m for m in mutants if in_kernels(m)]
            if not chosen:
                continue
            print(f"tier {tier}: {len(chosen)} mutants", flush=True)
            env = scratch_env(scratch, tier)
            check_imports_from(scratch, env)
            if with_baseline:
                baseline(scratch, chosen, env, timeout * 2)
            rows = out.setdefault(tier, [])
            for m in chosen:
                row = run_mutant(scratch, m, env, timeout, tier)
                print(f"  {row.result:<8} {m.name}  {row.by}  ({row.seconds:.0f} s)\n"
                      f"           {row.why[:150]}", flush=True)
                rows.append(row)
        return out
    finally:
        if keep:
            print(f"scratch copy kept at {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
