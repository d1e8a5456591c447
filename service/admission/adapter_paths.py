"""Where a tenant's run-time adapter load may read from: inside its ``adapter_root``.

The requested path (relative to the root, or absolute) is resolved with every symlink and
``..`` followed, and refused unless the directory and each file the loader reads from it
(``adapter_config.json``, ``adapter_model.safetensors``) resolve inside the root. The
refusal is the same whether or not anything exists outside the root, so it tells a tenant
nothing about the rest of the filesystem.
"""

from __future__ import annotations

from pathlib import Path

from service.model.lora import CONFIG_FILE, WEIGHTS_FILE

OUTSIDE = "must name a directory inside this tenant's adapter_root"
NOT_AN_ADAPTER = "names no adapter directory"


class AdapterPathError(ValueError):
    """The requested path cannot be loaded; the message says why (for ``lora_path``)."""


def resolve_inside(root: str, requested: str) -> Path:
    """The adapter directory ``requested`` names inside ``root``, fully resolved. Raises
    ``AdapterPathError`` when it (or a file the loader reads in it) resolves outside, or is
    not a directory."""
    if not requested or "\0" in requested:
        raise AdapterPathError(OUTSIDE)
    base = Path(root).resolve()
    target = (base / requested).resolve()  # an absolute ``requested`` replaces ``base``
    if not target.is_relative_to(base):
        raise AdapterPathError(OUTSIDE)
    if not target.is_dir():
        raise AdapterPathError(NOT_AN_ADAPTER)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (target / name).resolve().is_relative_to(base):
            raise AdapterPathError(OUTSIDE)
    return target
