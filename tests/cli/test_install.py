"""Packaging: the client-only install names the `server` extra; pip builds without warnings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.conftest import ROOT, clean_env


def _without(module: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """`kvfence ARGV` as on the client-only install: importing MODULE fails there."""
    code = (f"import sys; sys.modules[{module!r}] = None\n"
            "from service.serve.commands import main\n"
            f"sys.exit(main({list(argv)!r}))")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("module", "argv"), [
    ("torch", ("serve", "--port", "0")),
    ("jinja2", ("models", "pull")),
])
def test_server_command_on_the_client_install_names_the_extra(
        module: str, argv: tuple[str, ...], tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[tenants.a]\napi_key_sha256 = ["' + "0" * 64 + '"]\n')
    run = _without(module, *argv, *(("--tenants", str(tenants)) if argv[0] == "serve" else ()))
    assert run.returncode == 1
    assert run.stderr == ("kvfence: error: this command needs the server install (no module "
                          f"named {module!r}): pip install 'kvfence[server]'\n")
    client_verb = _without(module, "tokenize", "--help")  # the client install itself works
    assert client_verb.returncode == 0 and client_verb.stdout.startswith("usage: kvfence tokenize")


def test_building_the_package_prints_no_warning(tmp_path: Path) -> None:
    """What `pip install .` builds, with this venv's setuptools (>= 77, as pyproject requires):
    the metadata (license) and the wheel raise no warning."""
    run = subprocess.run(
        [sys.executable, "-W", "error::Warning", "-m", "pip", "wheel", "--no-deps",
         "--no-build-isolation", "--no-cache-dir", "-w", str(tmp_path), str(ROOT)],
        cwd=tmp_path, env=clean_env({"PYTHONWARNINGS": "error"}), capture_output=True,
        text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    own = [line for line in (run.stdout + run.stderr).splitlines()
           if "Warning" in line or "deprecated" in line]
    assert own == []
    [wheel] = tmp_path.glob("kvfence-*.whl")
    assert wheel.is_file()
