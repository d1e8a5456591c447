"""Every unloadable input raises ModelLoadError with one line naming the file and the problem."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from service.model import ModelLoadError, load_model
from tests.fixtures.tiny_gguf import write_gguf_from_hf
from tests.fixtures.tiny_models import write_tiny_llama


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny_gguf(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf_from_hf(tiny_dir, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def _load_error(path: Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model(path, dtype="float32", progress=False)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_file(tmp_path: Path) -> None:
    message = _load_error(tmp_path / "nope.gguf")
    assert "nope.gguf" in message and "no such file" in message


@pytest.mark.parametrize("keep", [10, 200, 5000, 0.5, 0.999])
def test_truncated_gguf(tiny_gguf: Path, tmp_path: Path, keep: float) -> None:
    data = tiny_gguf.read_bytes()
    cut = int(len(data) * keep) if isinstance(keep, float) else keep
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:cut])
    message = _load_error(bad)
    assert "cut.gguf" in message and ("truncated" in message or "corrupt" in message)


def test_truncated_default_gguf(default_model_path: Path, tmp_path: Path) -> None:
    bad = tmp_path / "half.gguf"
    with default_model_path.open("rb") as f:
        bad.write_bytes(f.read(200_000))  # cut inside the token list
    assert "half.gguf" in _load_error(bad)


def test_corrupt_gguf_magic(tiny_gguf: Path, tmp_path: Path) -> None:
    data = bytearray(tiny_gguf.read_bytes())
    data[:4] = b"GGUX"
    bad = tmp_path / "magic.gguf"
    bad.write_bytes(bytes(data))
    message = _load_error(bad)
    assert "magic.gguf" in message and "not a valid GGUF" in message


def test_corrupt_gguf_header(tiny_gguf: Path, tmp_path: Path) -> None:
    data = bytearray(tiny_gguf.read_bytes())
    data[8:40] = b"\xff" * 32  # tensor/kv counts and the first key length
    bad = tmp_path / "header.gguf"
    bad.write_bytes(bytes(data))
    assert "header.gguf" in _load_error(bad)


def test_truncated_safetensors(tiny_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    message = _load_error(broken)
    assert "model.safetensors" in message and "truncated" in message


def test_unsupported_architecture_hf(tiny_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "gpt2ish"
    other.mkdir()
    for f in tiny_dir.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    config = json.loads((other / "config.json").read_text())
    config["model_type"] = "gpt2"
    (other / "config.json").write_text(json.dumps(config))
    message = _load_error(other)
    assert "gpt2ish" in message and "unsupported architecture 'gpt2'" in message


def test_unsupported_architecture_gguf(tiny_dir: Path, tmp_path: Path) -> None:
    path = write_gguf_from_hf(tiny_dir, tmp_path / "falcon.gguf", arch="falcon")
    message = _load_error(path)
    assert "falcon.gguf" in message and "unsupported architecture 'falcon'" in message


def test_unsupported_tensor_type(tiny_dir: Path, tmp_path: Path) -> None:
    path = write_gguf_from_hf(
        tiny_dir, tmp_path / "f64.gguf", overrides={"output_norm.weight": np.ones(64)}
    )
    message = _load_error(path)
    assert "f64.gguf" in message and "unsupported tensor type F64" in message


def test_missing_tokenizer(tiny_dir: Path, tmp_path: Path) -> None:
    partial = tmp_path / "notok"
    partial.mkdir()
    for name in ("config.json", "model.safetensors"):
        (partial / name).write_bytes((tiny_dir / name).read_bytes())
    message = _load_error(partial)
    assert "notok" in message and "tokenizer.json" in message


def test_not_a_model(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\x00" * 64)
    assert "weights.bin" in _load_error(path)
