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
        # Request preparation serves both fronts and knows neither.
        ("service/request_prep", ("grpc", "service.http", "service.inference_servicer",
                                  "service.grpc_server")),
    ],
)
def test_import_arrows(package: str, forbidden: tuple[str, ...]) -> None:
    assert _offenders(package, forbidden) == []


def test_service_model_and_engine_do_not_import_the_server_layer() -> None:
    allowed = ("service.model", "service.engine")
    bad = []
    for package in ("service/model", "service/engine"):
        for file, mods in _package_imports(package).items():
            for mod in mods:
                if mod.startswith("service.") and not mod.startswith(allowed):
                    bad.append(f"{file} imports {mod}")
    assert bad == []


def test_flashinfer_is_imported_only_inside_its_backend() -> None:
    bad = []
    for package in ("kvcache", "service", "clients"):
        for file, mods in _package_imports(package).items():
            if any(m.split(".")[0] == "flashinfer" for m in mods) and "flashinfer" not in file:
                bad.append(file)
    assert bad == []


def test_client_side_imports_need_no_torch() -> None:
    code = (
        "import sys, clients, service.cli\n"
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


def test_service_top_level_reaches_kvcache_only_at_the_composition_root() -> None:
    """The servicers see the engine's API (which re-exports the few cache value types);
    only the composition root names kvcache: ``app.py``, which builds the stack, and
    ``config.py``, which derives kvcache's ``CacheConfig`` from the flags."""
    bad = []
    for path in sorted((ROOT / "service").glob("*.py")):
        mods = {m for m in _imports(path) if m == "kvcache" or m.startswith("kvcache.")}
        if mods and path.name not in ("app.py", "config.py"):
            bad.append(f"{path.name} imports {sorted(mods)}")
    assert bad == []
