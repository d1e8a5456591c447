"""The import arrows of docs/architecture.md, checked on the source.

Only kvcache reads or writes KV memory; that argument is short only while these hold.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def _package_imports(package: str) -> dict[str, set[str]]:
    return {str(p.relative_to(ROOT)): _imports(p) for p in sorted((ROOT / package).rglob("*.py"))}


def _offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for file, mods in _package_imports(package).items():
        for mod in mods:
            if any(mod == f or mod.startswith(f + ".") for f in forbidden):
                bad.append(f"{file} imports {mod}")
    return bad


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("kvcache", ("grpc", "service", "clients", "protos", "transformers")),
        ("clients", ("torch", "service", "kvcache")),
        ("protos", ("service", "kvcache", "clients", "torch")),
        ("service/model", ("grpc", "protos", "service.engine", "clients")),
        ("service/engine", ("grpc", "protos", "clients")),
        # Admission serves both fronts and knows neither.
        ("service/admission", ("grpc", "service.grpc", "service.http", "service.serve")),
        ("service/structured", ("grpc", "service.grpc", "service.http", "service.serve",
                                "service.admission")),
        ("service/telemetry", ("service.grpc", "service.http", "service.serve",
                               "service.admission")),
        # The two fronts keep their wire format and share admission; neither imports the other.
        ("service/grpc", ("service.http", "service.serve")),
        ("service/http", ("service.grpc", "service.serve")),
    ],
)
def test_import_arrows(package: str, forbidden: tuple[str, ...]) -> None:
    assert _offenders(package, forbidden) == []


#: Which service packages each may import (its own always); ``serve`` (the composition root)
#: may import them all, and nothing imports ``serve``.
_SERVICE_ARROWS = {
    "model": (),
    "structured": ("engine.types", "model", "errors", "json_input", "held_work"),
    "engine": ("model", "structured.grammar", "structured.grammar_depth",
               "structured.compile_executor"),
    "telemetry": ("engine", "errors"),
    "admission": ("engine", "model", "structured", "telemetry", "errors", "protocols",
                  "json_input", "held_work"),
    "grpc": ("admission", "engine", "model", "structured", "telemetry", "errors", "protocols"),
    "http": ("admission", "engine", "model", "structured", "telemetry", "errors", "protocols",
             "json_input"),
}

#: The grammar runtime the engine runs sits below it: it imports nothing else of ``service``.
_GRAMMAR_RUNTIME = ("grammar.py", "grammar_depth.py", "compile_executor.py")


def _service_arrow_offenders() -> list[str]:
    bad = []
    for pkg, allowed in _SERVICE_ARROWS.items():
        for file, mods in _package_imports(f"service/{pkg}").items():
            ok = () if Path(file).name in _GRAMMAR_RUNTIME and pkg == "structured" else allowed
            for mod in mods:
                if not mod.startswith("service.") or mod.startswith(f"service.{pkg}"):
                    continue
                rest = mod.removeprefix("service.")
                if not any(rest == a or rest.startswith(a + ".") for a in ok):
                    bad.append(f"{file} imports {mod}")
    return bad


def test_service_packages_import_only_their_arrows() -> None:
    """The arrows between the service packages (docs/architecture.md): the engine reaches
    only the model and the grammar runtime, admission knows no front, the fronts know
    neither each other nor the process setup."""
    assert _service_arrow_offenders() == []


def test_service_packages_cover_the_tree() -> None:
    """Every service package has its arrows written down, and the top level stays small."""
    packages = {p.name for p in (ROOT / "service").iterdir()
                if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == {*_SERVICE_ARROWS, "serve"}
    top = sorted(p.name for p in (ROOT / "service").glob("*.py"))
    assert len(top) <= 12, top


def test_nothing_imports_the_process_setup() -> None:
    bad = []
    for package in ("service", "kvcache", "clients"):
        for file, mods in _package_imports(package).items():
            if file.startswith("service/serve/"):
                continue
            bad.extend(f"{file} imports {m}" for m in mods if m.startswith("service.serve"))
    assert bad == []


def test_service_model_and_engine_do_not_import_the_server_layer() -> None:
    allowed = ("service.model", "service.engine", "service.structured.grammar",
               "service.structured.compile_executor")
    bad = []
    for package in ("service/model", "service/engine"):
        for file, mods in _package_imports(package).items():
            for mod in mods:
                if mod.startswith("service.") and not mod.startswith(allowed):
                    bad.append(f"{file} imports {mod}")
    assert bad == []


def test_no_two_service_modules_share_a_name() -> None:
    """A module's name says what it holds: within ``service/`` (its families aside, one file
    per architecture) no two modules share a name."""
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "service").rglob("*.py")):
        rel = path.relative_to(ROOT)
        if path.name in ("__init__.py", "__main__.py") or "families" in rel.parts:
            continue
        seen.setdefault(path.name, []).append(str(rel))
    assert {n: f for n, f in seen.items() if len(f) > 1} == {}


def test_flashinfer_is_imported_only_inside_its_backend() -> None:
    bad = []
    for package in ("kvcache", "service", "clients"):
        for file, mods in _package_imports(package).items():
            if any(m.split(".")[0] == "flashinfer" for m in mods) and "flashinfer" not in file:
                bad.append(file)
    assert bad == []


def test_client_side_imports_need_no_torch() -> None:
    """The client verbs and ``kvfence serve``'s checks before loading (preflight, the HTTP
    guard) answer in well under a second: they load no torch."""
    code = (
        "import sys, clients, service.serve.commands, service.serve.preflight\n"
        "import service.http.guard\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'kvcache') "
        "or m.startswith(('service.model', 'service.engine.')) "
        "and m != 'service.engine.tuning']\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


#: Private state and who owns it: a reach-in from anywhere else fails the test below.
_PRIVATE_OWNERS = {
    "_lock": "service/engine/",
    "_seqs": "service/engine/",
    "_pages": "kvcache/",
    "_tables": "kvcache/",
}


def _reach_ins(source: str, rel: str) -> list[str]:
    """``x._lock``/``x._seqs``/``x._pages``/``x._tables`` on anything but ``self``, and
    ``x.core.cache`` (the engine's cache taken from outside its thread)."""
    found = []
    for node in ast.walk(ast.parse(source, filename=rel)):
        if not isinstance(node, ast.Attribute):
            continue
        owner = _PRIVATE_OWNERS.get(node.attr)
        on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
        if owner is not None and not on_self and not rel.startswith(owner):
            found.append(f"{rel}:{node.lineno}: .{node.attr}")
        core = node.value
        named_core = (isinstance(core, ast.Attribute) and core.attr == "core") or (
            isinstance(core, ast.Name) and core.id == "core"
        )
        if node.attr == "cache" and named_core and not rel.startswith("service/engine/"):
            found.append(f"{rel}:{node.lineno}: core.cache")
    return found


def test_no_private_reach_ins_outside_the_owning_package() -> None:
    """Tests, bench and the service use the engine's and the cache's public API (and their
    documented test hooks), never their locks, tables or request maps."""
    bad = []
    for package in ("service", "kvcache", "clients", "tests", "bench", "examples"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            bad.extend(_reach_ins(path.read_text(), rel))
    assert bad == []


def test_reach_in_check_catches_each_form() -> None:
    source = (
        "def f(engine, mgr, core, alloc):\n"
        "    with engine.core._lock:\n"
        "        core._seqs\n"
        "    engine.core.cache\n"
        "    mgr._tables, alloc._pages\n"
        "    self._lock\n"
    )
    found = [f.split(": ", 1)[1] for f in _reach_ins(source, "tests/probe.py")]
    assert sorted(found) == sorted(["._lock", "._seqs", "core.cache", "._tables", "._pages"])
    # The owning package may use its own private state.
    assert _reach_ins("mgr._tables\n", "kvcache/probe.py") == []


def test_service_reaches_kvcache_only_at_the_composition_root() -> None:
    """The fronts and admission see the engine's API (which re-exports the few cache value
    types); outside the engine and the model only the composition root names kvcache:
    ``serve/app.py``, which builds the stack, and ``serve/settings.py``, which derives
    kvcache's ``CacheConfig`` from the flags."""
    bad = []
    for path in sorted((ROOT / "service").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel.startswith(("service/engine/", "service/model/")):
            continue
        mods = {m for m in _imports(path) if m == "kvcache" or m.startswith("kvcache.")}
        if mods and rel not in ("service/serve/app.py", "service/serve/settings.py"):
            bad.append(f"{rel} imports {sorted(mods)}")
    assert bad == []


def test_arrow_check_catches_a_wrong_arrow(tmp_path: Path) -> None:
    """The arrow check reads real imports: a front importing the other front is caught."""
    probe = tmp_path / "probe.py"
    probe.write_text("from service.http.front import OpenAIFront\nimport service.grpc.wire\n")
    assert _imports(probe) == {"service.http.front", "service.grpc.wire"}


def test_engine_test_hooks_come_from_the_factory() -> None:
    """The cache's test hooks are reached through ``service/engine/hooks.py`` (made by the
    factory, which holds the cache), never through the engine's layers; the scheduler
    forwards none of the cache's queries (the core asks them through ``CacheQueries``)."""
    hooks = ("inject_stale_page", "observe_frees", "on_free")
    bad = []
    for path in sorted((ROOT / "service").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel in ("service/engine/hooks.py", "service/engine/factory.py"):
            continue
        text = path.read_text()
        bad.extend(f"{rel} names {h}" for h in hooks if h in text)
    scheduler = (ROOT / "service/engine/scheduler.py").read_text()
    for query in ("def usage", "def purge", "def cache_stats", "def evict_expired",
                  "def set_cache_policy", "def withdraw_shared", "def num_free_pages"):
        if query in scheduler:
            bad.append(f"scheduler.py forwards {query.removeprefix('def ')}")
    assert bad == []
