"""The mutation suite stays aimed: every mutant's anchors occur exactly once in today's tree and
every mutant names the tests that guard it. A refactor that moves a guarded line fails here, in
`make test`, instead of leaving `make mutants` to report a stale mutant later."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.mutants.catalog import ALL
from tools.mutants.mutant import Mutant, mutated_sources

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("m", ALL, ids=[m.name for m in ALL])
def test_mutant_applies_to_the_current_tree(m: Mutant) -> None:
    sources = mutated_sources(ROOT, m)
    assert sources, m.name
    for path, text in sources.items():
        assert text != path.read_text(encoding="utf-8"), f"{m.name} changes nothing in {path}"
    assert m.tests, f"{m.name} names no guarding test"
    for target in m.tests:
        assert (ROOT / target.split("::")[0]).exists(), f"{m.name}: {target} does not exist"


def test_mutant_names_are_unique() -> None:
    names = [m.name for m in ALL]
    assert len(names) == len(set(names))


def test_a_mutant_whose_tests_all_skip_here_is_not_run_and_fails_nothing(tmp_path: Path) -> None:
    """A guarding test that runs, passes and lets a mutant live is SURVIVED; guarding tests
    that all skip on this machine (code it does not run) make the mutant "not run": reported,
    neither killed nor survived, and the run still passes."""
    from tools.mutants.mutant import edit, mutant
    from tools.mutants.run import run_mutant

    (tmp_path / "code.py").write_text("VALUE = 1\n")
    (tmp_path / "test_runs.py").write_text("def test_runs():\n    assert True\n")
    (tmp_path / "test_skips.py").write_text(
        "import pytest\n\n@pytest.mark.skip(reason='no tile unit on this CPU')\n"
        "def test_skips():\n    assert False\n"
    )
    change = edit("code.py", "VALUE = 1", "VALUE = 2")
    env = {"PATH": "/usr/bin:/bin"}
    survived = run_mutant(tmp_path, mutant("m1", "g", change, tests="test_runs.py"), env, 60)
    skipped = run_mutant(tmp_path, mutant("m2", "g", change, tests="test_skips.py"), env, 60)
    assert (survived.result, survived.passed) == ("SURVIVED", False)
    assert (skipped.result, skipped.passed, skipped.killed) == ("not run", True, False)
    assert "no tile unit on this CPU" in skipped.why
    assert (tmp_path / "code.py").read_text() == "VALUE = 1\n"  # restored


def test_a_mutant_of_code_for_hardware_this_machine_lacks_is_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mutant that needs hardware (the tile unit) the machine's kernel lacks is reported as
    not run without running its tests; where the kernel has it, the tests decide."""
    from tools.mutants import mutant as mutant_module
    from tools.mutants.mutant import edit, mutant
    from tools.mutants.run import run_mutant

    (tmp_path / "code.py").write_text("VALUE = 1\n")
    (tmp_path / "test_runs.py").write_text("def test_runs():\n    assert False\n")
    m = mutant("m", "g", edit("code.py", "VALUE = 1", "VALUE = 2"), tests="test_runs.py",
               needs="amx")
    env = {"PATH": "/usr/bin:/bin"}
    monkeypatch.setitem(mutant_module.HARDWARE, "amx", "False")
    lacking = run_mutant(tmp_path, m, env, 60)
    assert (lacking.result, lacking.passed) == ("not run", True)
    monkeypatch.setitem(mutant_module.HARDWARE, "amx", "True")
    assert run_mutant(tmp_path, m, env, 60).result == "killed"
    with pytest.raises(ValueError, match="needs 'gpu'"):
        mutant("m", "g", tests="t.py", needs="gpu")


def test_a_kernel_mutant_a_tier_compiles_to_the_same_code_is_not_run_there(
    tmp_path: Path,
) -> None:
    """A C edit inside code one build leaves out (an AVX2 path in the portable build) is not
    run on that build: its assembly is the same with and without the edit. The build that
    contains the code runs the tests, which decide."""
    from tools.mutants.mutant import edit, mutant
    from tools.mutants.run import run_mutant

    source = "int f(int x) {\n#ifdef __AVX2__\n    return x + 1;\n#else\n    return x;\n#endif\n}\n"
    (tmp_path / "k.c").write_text(source)
    (tmp_path / "test_runs.py").write_text("def test_runs():\n    assert False\n")
    m = mutant("m", "g", edit("k.c", "return x + 1;", "return x + 2;"), tests="test_runs.py")
    env = {"PATH": "/usr/bin:/bin"}
    portable = run_mutant(tmp_path, m, env, 60, "portable")
    assert (portable.result, portable.passed) == ("not run", True)
    assert "portable build compiles it to the same code" in portable.why
    assert run_mutant(tmp_path, m, env, 60, "avx2").result == "killed"
    assert (tmp_path / "k.c").read_text() == source  # restored either way


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ("flags : fpu sse2 avx avx2 fma f16c bmi2", ("native", "portable")),
        ("flags : fpu avx avx2 fma f16c avx512f avx512_vnni", ("native", "avx2", "portable")),
        ("flags : fpu avx avx2 fma f16c amx_tile", ("native", "avx2", "portable")),
        ("flags : fpu sse2", ("native", "portable")),
    ],
)
def test_the_mutants_run_on_each_kernel_build_the_cpu_runs(
    flags: str, expected: tuple[str, ...]
) -> None:
    from kvcache.native_build import tiers

    assert tiers(flags) == expected
