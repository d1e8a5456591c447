"""`kvfence` CLI: tenants add, error exits, env-var flags, lazy imports, devserve setup."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from service.admission.tenants import load_tenants
from service.serve import commands as cli
from service.serve import dev
from service.serve.settings import ConfigError, parse_kv_memory
from tests.serverutil import ROOT
from tools.configuration_doc import actions, commands


def test_client_verbs_do_not_import_torch_or_the_engine() -> None:
    # service.engine.tuning is plain data (the flags' defaults); nothing else may load.
    code = (
        "import sys, service.serve.commands as c; c.build_parser(); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'kvcache') "
        "or m.startswith(('service.model', 'service.engine.')) and m != 'service.engine.tuning'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_tenants_add_prints_the_key_once_and_stores_its_hash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "tenants.toml"
    assert cli.main(["tenants", "add", "acme", "--file", str(path)]) == 0
    out = capsys.readouterr().out
    key = out.strip().splitlines()[-1].split()[-1]
    assert key.startswith("kvf_") and key not in path.read_text()
    owner = load_tenants(path).by_key(key)
    assert owner is not None and owner.name == "acme"
    assert cli.main(["tenants", "add", "acme", "--file", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already exists" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--model", "/nonexistent/model.gguf"], {}, "/nonexistent/model.gguf: no such file"),
        (["--tenants", "/nonexistent/tenants.toml"], {}, "tenants.toml: file not found"),
        (["--tls-cert", "a.pem"], {}, "--tls-cert and --tls-key go together"),
        (["--tls-client-ca", "ca.pem"], {}, "--tls-client-ca needs"),
        ([], {"KVFENCE_PORT": "http"}, "KVFENCE_PORT='http'"),
        ([], {"KVFENCE_REFLECTION": "maybe"}, "KVFENCE_REFLECTION"),
    ],
)
def test_bad_serve_input_is_one_line_and_exit_2(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    env: dict[str, str],
    message: str,
) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[tenants.a]\nmtls_identities = ["uri:x"]\n')
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    base = ["serve", "--tenants", str(tenants), "--model", str(tmp_path / "absent.gguf")]
    assert cli.main([*base, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_every_serve_flag_reads_its_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFENCE_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("KVFENCE_KV_MEMORY", "0.25")
    monkeypatch.setenv("KVFENCE_LOG_CONTENT", "true")
    monkeypatch.setenv("KVFENCE_TLS_CLIENT_CA", "/ca.pem")
    args = cli.parse_args(["serve", "--max-num-seqs", "9"])
    assert args.max_num_seqs == 9  # the flag wins
    assert (args.kv_memory, args.log_content, args.tls_client_ca) == ("0.25", True, "/ca.pem")
    assert cli.parse_args(["serve"]).served_model_name is None
    monkeypatch.setenv("KVFENCE_SERVED_MODEL_NAME", "smol, small")
    assert cli.parse_args(["serve"]).served_model_name == ("smol", "small")
    assert cli.parse_args(["serve", "--served-model-name", "x"]).served_model_name == ["x"]
    serve = dict(commands(cli.build_parser()))["kvfence serve"]
    for action in actions(serve):
        if action.option_strings and action.dest != "help":
            assert f"[env KVFENCE_{action.dest.upper()}]" in (action.help or "")


def test_kv_memory_sizes() -> None:
    assert parse_kv_memory("512MiB") == ("bytes", 512 * 2**20)
    assert parse_kv_memory("2GB") == ("bytes", 2e9)
    assert parse_kv_memory("1073741824") == ("bytes", 2**30)
    assert parse_kv_memory("0.5") == ("fraction", 0.5)
    for bad in ("lots", "-1GiB", "0"):
        with pytest.raises(ConfigError):
            parse_kv_memory(bad)


def test_devserve_creates_a_dev_tenant_once(tmp_path: Path) -> None:
    tenants = tmp_path / "dev" / "tenants.toml"
    key = dev.ensure_dev_tenant(tenants)
    assert (tmp_path / "dev" / "dev-key.txt").read_text().strip() == key
    owner = load_tenants(tenants).by_key(key)
    assert owner is not None and owner.name == "dev"
    assert dev.ensure_dev_tenant(tenants) == key  # reused, not rotated
    assert oct((tmp_path / "dev" / "dev-key.txt").stat().st_mode & 0o777) == "0o600"
