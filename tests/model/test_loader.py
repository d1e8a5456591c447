"""load_model plumbing: dtype resolution and the progress line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from service.model import load_model
from service.model.loader import cpu_has_bf16, resolve_dtype, tier_has_bf16
from tests.fixtures.tiny_models import write_tiny_qwen2


def test_cpu_bf16_detection_reads_flags(tmp_path: Path) -> None:
    with_amx = tmp_path / "amx"
    with_amx.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f amx_bf16 amx_tile\n")
    plain = tmp_path / "plain"
    plain.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2\n")
    assert cpu_has_bf16(with_amx) and not cpu_has_bf16(plain)
    assert not cpu_has_bf16(tmp_path / "absent")


@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_a_forced_lower_tier_computes_as_a_cpu_without_bf16(
    isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("service.model.loader.cpu_has_bf16", lambda: True)
    monkeypatch.setenv("KVFENCE_KERNEL_ISA", "native")
    assert tier_has_bf16()
    monkeypatch.setenv("KVFENCE_KERNEL_ISA", isa)
    assert not tier_has_bf16()
    assert resolve_dtype("auto", "cpu") == torch.float32
    monkeypatch.setenv("KVFENCE_KERNEL_ISA", "sse9")  # refused by the kernels, not here
    assert tier_has_bf16()


def test_resolve_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_dtype("float32", "cuda") == torch.float32
    assert resolve_dtype("float16", "cpu") == torch.float16
    assert resolve_dtype("auto", "cuda:0") == torch.bfloat16
    monkeypatch.setattr("service.model.loader.tier_has_bf16", lambda: False)
    assert resolve_dtype("auto", "cpu") == torch.float32
    monkeypatch.setattr("service.model.loader.tier_has_bf16", lambda: True)
    assert resolve_dtype("auto", "cpu", "bf16") == torch.bfloat16
    # 4-bit decode weights: float32 compute through kvfence's GEMV where it builds
    monkeypatch.setattr("service.model.native.kernels.kernel", lambda: None)
    assert resolve_dtype("auto", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int8", "cpu")


def test_progress_goes_to_stderr_only_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_tiny_qwen2(tmp_path / "q2")
    capsys.readouterr()
    loaded = load_model(path, dtype="float32", progress=True)
    err = capsys.readouterr().err
    assert "loading q2" in err and "100%" in err
    load_model(path, dtype="float32", progress=False)
    assert "loading" not in capsys.readouterr().err
    assert loaded.name == "q2" and loaded.path == path and loaded.dtype == torch.float32


def test_an_empty_kernel_isa_is_the_default_build(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcache import native_build

    monkeypatch.setenv("KVFENCE_KERNEL_ISA", "")
    assert native_build.march() == "native"
    monkeypatch.setenv("KVFENCE_KERNEL_ISA", "sse9")
    with pytest.raises(native_build.KernelBuildError, match="use one of native, avx2, portable"):
        native_build.march()
