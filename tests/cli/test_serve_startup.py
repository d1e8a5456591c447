"""`kvfence serve` fails fast: flags, tenants file, TLS files and the port before the model."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.cli.conftest import GRPC_CORE_LINE, RealServer, free_port, kvfence
from tests.serverutil import TenantSpec, write_tenants_file


@pytest.fixture
def tenants(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.toml"
    write_tenants_file(path, {"acme": TenantSpec()})
    return path


def _serve(*args: str, timeout: float = 300.0) -> tuple[int, list[str], float]:
    """Run `kvfence serve ARGS` on the default model with JSON logs: (exit, stderr lines, s)."""
    started = time.monotonic()
    run = kvfence("serve", "--log-format", "json", *args, timeout=timeout)
    elapsed = time.monotonic() - started
    assert run.stdout == ""  # never got as far as the serving line
    assert not GRPC_CORE_LINE.search(run.stderr), run.stderr
    return run.returncode, run.stderr.splitlines(), elapsed


def test_second_server_on_a_used_port_fails_in_one_line_under_3s(
        plain_server: RealServer) -> None:
    port = str(plain_server.process.port)
    code, lines, elapsed = _serve("--port", port, "--tenants", str(plain_server.tenants))
    assert code == 2
    assert lines == [f"kvfence: error: --port {port}: 127.0.0.1:{port} is already in use "
                     "(another kvfence serve?); stop that process or pick another port "
                     "(--port 0 picks a free one)"]
    assert elapsed < 3.0


@pytest.mark.parametrize(("flags", "message"), [
    (["--kv-memory", "lots"], "--kv-memory: cannot parse 'lots' (use e.g. 512MiB, 2GB or 0.5)"),
    (["--max-num-seqs", "0"], "--max-num-seqs 0: must be at least 1"),
    (["--page-size", "-4"], "--page-size -4: must be at least 1"),
    (["--model", "/nonexistent/model.gguf"],
     "--model /nonexistent/model.gguf: no such file or directory; give a .gguf file, "
     "a Hugging Face directory or repository (ORG/NAME[:FILE]), 'default' or a name "
     "`kvfence models list` shows"),
    (["--tls-cert", "README.md", "--tls-key", "README.md"],
     "--tls-cert README.md --tls-key README.md: not a PEM certificate and its key "
     "(no PEM data found)"),
    (["--metrics-port", "70000"], "--metrics-port 70000: use 1-65535, or 0 for any free port"),
    (["--http-port", "70000"], "--http-port 70000: use 1-65535, or 0 for any free port"),
])
def test_bad_flag_fails_in_one_line_before_the_model_loads(
        flags: list[str], message: str, tenants: Path) -> None:
    code, lines, _ = _serve("--port", str(free_port()), "--tenants", str(tenants), *flags)
    assert (code, lines) == (2, [f"kvfence: error: {message}"])


def test_typed_dtype_and_device(tenants: Path) -> None:
    code, lines, _ = _serve("--tenants", str(tenants), "--dtype", "foo")
    assert code == 2
    assert lines[-1] == ("kvfence serve: error: argument --dtype: invalid choice: 'foo' "
                         "(choose from 'auto', 'float32', 'bfloat16', 'float16')")
    code, lines, _ = _serve("--tenants", str(tenants), "--device", "gpu")
    assert code == 2
    assert lines[-1] == ("kvfence serve: error: argument --device: use cpu, cuda or cuda:N "
                         "(got 'gpu')")


def test_cuda_that_is_not_there_is_named(tenants: Path) -> None:
    import torch

    device = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU, on any machine
    code, lines, _ = _serve("--port", str(free_port()), "--tenants", str(tenants),
                            "--device", device)
    assert code == 2
    [line] = lines
    assert line.startswith(f"kvfence: error: --device {device}: ")
    if torch.version.cuda is None:
        assert "built without CUDA" in line
    assert "use --device cpu" in line


def test_missing_tenants_file_says_how_to_make_one(tmp_path: Path) -> None:
    missing = tmp_path / "tenants.toml"
    code, lines, _ = _serve("--port", str(free_port()), "--tenants", str(missing))
    assert (code, lines) == (2, [
        f"kvfence: error: --tenants {missing}: file not found; `kvfence tenants add NAME "
        f"--file {missing}` creates a tenant and prints its key"])


def test_empty_tenants_file_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "tenants.toml"
    empty.write_text("# no tenants yet\n")
    code, lines, _ = _serve("--port", str(free_port()), "--tenants", str(empty))
    assert (code, lines) == (2, [
        f"kvfence: error: --tenants {empty}: no tenants in it, so every call would be refused; "
        f"`kvfence tenants add NAME --file {empty}` creates a tenant and prints its key"])


@pytest.mark.slow
def test_compile_on_where_it_cannot_run_says_why(tenants: Path) -> None:
    code, lines, _ = _serve("--port", str(free_port()), "--tenants", str(tenants),
                            "--dtype", "float32", "--compile", "on")
    assert code == 2
    assert lines[-1] == ("kvfence: error: --compile on: the compiled decode path cannot run: "
                         "it needs bf16 compute (dtype is float32: pass --dtype bfloat16)")
