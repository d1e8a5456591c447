"""The import arrows of ARCHITECTURE.md, checked on the source.

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
    return {
        str(p.relative_to(ROOT)): _imports(p) for p in sorted((ROOT / package).rglob("*.py"))
    }


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
        "heavy = [m for m in ('torch', 'kvcache', 'service.engine', 'service.model') "
        "if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
