"""Models named by Hugging Face repository: ``kvfence serve --model ORG/NAME[:FILE]``.

huggingface_hub owns everything about fetching: its cache (``HF_HOME``, ``HF_HUB_CACHE``),
offline mode (``HF_HUB_OFFLINE``), credentials (``HF_TOKEN``) and revision pinning. This module
only decides which of a repository's files make the model:

- ``ORG/NAME:FILE`` is the GGUF file ``FILE`` inside the repository;
- ``ORG/NAME`` with ``config.json`` and ``*.safetensors`` is a directory model (the snapshot
  directory, holding the weights, config and tokenizer files only);
- ``ORG/NAME`` with exactly one ``.gguf`` is that file; with several, or with neither, the
  name is refused in one line that lists what the repository holds.

Every failure is a :class:`ModelLoadError` of one line, never a traceback.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from service.model.load_error import ModelLoadError

# A repository id as the Hub spells it, then an optional ``:FILE`` (a path inside the repo).
_SPEC = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?::(?P<file>[^:]+))?$")
# The files a directory model needs: weights, config, tokenizer and chat template.
DIRECTORY_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]


@dataclass(frozen=True, slots=True)
class HubModel:
    """``ORG/NAME[:FILE]`` from ``--model``."""

    repo_id: str
    file: str | None = None

    def __str__(self) -> str:
        return self.repo_id if self.file is None else f"{self.repo_id}:{self.file}"


def parse_hub_name(text: str) -> HubModel | None:
    """The repository ``text`` names, or None where it is not of the form ``ORG/NAME[:FILE]``
    (a local path that exists is never passed here: ``serve`` checks paths first)."""
    match = _SPEC.match(text)
    # NOTE: "models/tiny.gguf" is a mistyped path far more often than a repository's name.
    if match is None or match.group("repo").endswith(".gguf"):
        return None
    file = match.group("file")
    if file is not None and not file.endswith(".gguf"):
        raise ModelLoadError(f"--model {text}: FILE must be a .gguf file inside {match['repo']}")
    return HubModel(match.group("repo"), file)


def resolve_hub_model(model: HubModel, *, revision: str | None, progress: bool) -> Path:
    """The local path of ``model`` at ``revision`` (None: the ``main`` branch), downloading
    into the Hugging Face cache what is not there yet (nothing, under ``HF_HUB_OFFLINE``).
    ``progress`` shows huggingface_hub's download bars (on a terminal only)."""
    from huggingface_hub.utils.tqdm import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    quiet = not progress and not are_progress_bars_disabled()
    if quiet:
        disable_progress_bars()
    try:
        return _resolve(model, revision)
    except ModelLoadError:
        raise
    except Exception as err:  # huggingface_hub's errors, mapped to one line each
        raise ModelLoadError(f"--model {model}: {_explain(err, model, revision)}") from None
    finally:
        if quiet:
            enable_progress_bars()


def _resolve(model: HubModel, revision: str | None) -> Path:
    from huggingface_hub import hf_hub_download, snapshot_download

    if model.file is not None:
        return Path(hf_hub_download(model.repo_id, model.file, revision=revision))
    files = _repo_files(model.repo_id, revision)
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if "config.json" in files and any(f.endswith(".safetensors") for f in files):
        snapshot = snapshot_download(
            model.repo_id, revision=revision, allow_patterns=DIRECTORY_FILES
        )
        return Path(str(snapshot))
    if len(ggufs) == 1:
        return Path(hf_hub_download(model.repo_id, ggufs[0], revision=revision))
    if ggufs:
        raise ModelLoadError(
            f"--model {model}: the repository holds {len(ggufs)} GGUF files; pick one with "
            f"--model {model.repo_id}:FILE, FILE one of {', '.join(ggufs)}"
        )
    raise ModelLoadError(
        f"--model {model}: the repository holds neither config.json with *.safetensors nor a "
        ".gguf file, so kvfence cannot serve it"
    )


def _repo_files(repo_id: str, revision: str | None) -> set[str]:
    """The repository's file names: from the Hub, or under ``HF_HUB_OFFLINE`` from the
    cached snapshot (which raises ``LocalEntryNotFoundError`` where there is none)."""
    from huggingface_hub import HfApi, constants, snapshot_download

    if constants.HF_HUB_OFFLINE:
        snapshot = Path(str(snapshot_download(repo_id, revision=revision,
                                              local_files_only=True)))
        return {p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()}
    return {str(PurePosixPath(f)) for f in HfApi().list_repo_files(repo_id, revision=revision)}


def _explain(err: Exception, model: HubModel, revision: str | None) -> str:
    """One line for one of huggingface_hub's errors (checked by class name, most specific
    first: GatedRepoError is a RepositoryNotFoundError, both are HTTP errors)."""
    from huggingface_hub import constants

    names = [cls.__name__ for cls in type(err).__mro__]
    at = f" at revision {revision}" if revision else ""
    fetch = f"hf download {model.repo_id}" + (f" {model.file}" if model.file else "")
    fetch += f" --revision {revision}" if revision else ""
    if constants.HF_HUB_OFFLINE and (
        "LocalEntryNotFoundError" in names or "OfflineModeIsEnabled" in names
    ):
        return (f"not in the Hugging Face cache ({constants.HF_HUB_CACHE}){at} and "
                f"HF_HUB_OFFLINE is set; fetch it first with `{fetch}` (or unset HF_HUB_OFFLINE)")
    if "GatedRepoError" in names:
        return "the repository is gated: accept its terms on huggingface.co and set HF_TOKEN"
    if "RepositoryNotFoundError" in names:
        return ("no such local path, nor repository on the Hugging Face Hub (a private one "
                "needs HF_TOKEN)")
    if "RevisionNotFoundError" in names:
        return f"the repository has no revision {revision!r}"
    if "LocalEntryNotFoundError" in names:
        return (f"cannot reach the Hugging Face Hub and it is not in the cache "
                f"({constants.HF_HUB_CACHE}); check the network, or `{fetch}` elsewhere")
    if "EntryNotFoundError" in names:
        return f"the repository has no file {model.file!r}{at}"
    if "HFValidationError" in names:
        return f"not a valid repository name ({str(err).splitlines()[0]})"
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__
