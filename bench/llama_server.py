"""Peer: llama.cpp as its users serve it, ``llama-server`` with parallel slots.

The binaries come from ``make peers`` (tools/llamacpp_build.py): the llama.cpp sources that
the pinned llama-cpp-python sdist vendors, built with the same CPU flags as the ``bench``
extra, into ``~/.cache/kvfence/llama.cpp/<version>/bin/``. A server is one process with ``slots``
parallel sequences and continuous batching (llama-server's default), started on the cores the
suite gives it and driven over its OpenAI API by the same load generator as kvfence's HTTP
front (bench/http_client.py). Requests send ``cache_prompt: false``: kvfence's runs bypass its
prefix cache, and the suites repeat the same prompts, which llama-server's slot cache would
otherwise skip the prefill of.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from service.model.default import kvfence_home

ROOT = Path(__file__).resolve().parents[1]
SERVER, BATCHED_BENCH, LLAMA_BENCH = "llama-server", "llama-batched-bench", "llama-bench"
# Per request: llama-server refuses a prompt + max_tokens beyond a slot's context.
SLOT_CONTEXT = 512
# What every request carries besides the load generator's own fields.
REQUEST_EXTRA = {"cache_prompt": False}
API_KEY = "llama-server"  # the server runs without --api-key; the SDK needs some key


class PeerMissing(RuntimeError):
    """The llama.cpp binaries are not built (``make peers`` builds them)."""


def pinned_version(pyproject: Path = ROOT / "pyproject.toml") -> str:
    """The llama-cpp-python version the ``bench`` extra pins (``==``)."""
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    for req in extras["bench"]:
        name, sep, version = str(req).partition("==")
        if sep and name.strip() == "llama-cpp-python":
            return version.strip()
    raise ValueError(f"{pyproject}: the bench extra does not pin llama-cpp-python with ==")


def peer_root(version: str | None = None, tier: str = "native") -> Path:
    """Where ``make peers`` puts one version's source, build tree and binaries: beside the
    models, in kvfence's user cache (``$KVFENCE_HOME``, else ``$XDG_CACHE_HOME/kvfence``, else
    ``~/.cache/kvfence``), so every checkout on the machine shares one build. The native
    build is the version's folder; another kernel tier's (bench.llamacpp_flags.tiers) is a
    folder of that name inside it."""
    root = kvfence_home() / "llama.cpp" / (version or pinned_version())
    return root if tier == "native" else root / tier


def binary(name: str, tier: str = "native") -> Path:
    path = peer_root(tier=tier) / "bin" / name
    if not os.access(path, os.X_OK):
        raise PeerMissing(f"{path} is not built: run `make peers`")
    return path


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """One llama-server setting the suites sweep: parallel slots and the physical batch."""

    slots: int
    ubatch: int = 512
    threads: int = 1
    tier: str = "native"  # whose build runs (bench.llamacpp_flags.tiers)

    @property
    def label(self) -> str:
        built = "" if self.tier == "native" else f" ({self.tier} build)"
        return f"llama-server np={self.slots} ub={self.ubatch}{built}"

    def args(self, gguf: Path, port: int) -> list[str]:
        # -c is the whole KV cache, split between the slots; -b >= -ub, as llama.cpp requires.
        return [
            str(binary(SERVER, self.tier)), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(self.slots), "-c", str(self.slots * SLOT_CONTEXT),
            "-b", str(max(2048, self.ubatch)), "-ub", str(self.ubatch),
            "-t", str(self.threads), "-tb", str(self.threads), "--no-webui",
        ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def started(
    config: ServerConfig, gguf: Path, log: Path, cpus: set[int] | None = None,
    timeout_s: float = 120.0,
) -> Iterator[str]:
    """A running llama-server (pinned to ``cpus``); yields its OpenAI base URL (``.../v1``).
    Its output goes to ``log``; a server that exits or is not healthy in time is an error."""
    port = free_port()
    with log.open("ab") as out:
        proc = subprocess.Popen(
            config.args(gguf, port), stdout=out, stderr=subprocess.STDOUT,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
    try:
        deadline = time.monotonic() + timeout_s
        while not _healthy(f"http://127.0.0.1:{port}/health"):
            if proc.poll() is not None:
                tail = log.read_text(errors="replace").strip().splitlines()[-3:]
                raise RuntimeError(f"{config.label} exited with {proc.returncode}: {tail}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{config.label} not healthy after {timeout_s:.0f}s")
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


SLOTS = (1, 2, 4, 8, 16, 32)
QUICK_SLOTS = (1, 4)
UBATCHES = (256, 2048)  # tried at the best slot count, beside the default 512


def sweep(
    slots: Sequence[int],
    ubatches: Sequence[int],
    threads: int,
    measure: Callable[[ServerConfig], float],
    errors: dict[str, str],
    tier: str = "native",
) -> tuple[ServerConfig | None, dict[str, float]]:
    """The fastest configuration by ``measure`` (output tok/s) and every label's figure: each
    slot count at the default physical batch, then the other ``ubatches`` at the best count.
    A configuration that fails is recorded in ``errors`` and left out."""
    scores: dict[ServerConfig, float] = {}

    def one(config: ServerConfig) -> None:
        try:
            scores[config] = measure(config)
        except Exception as err:  # one failed setting must not lose the others
            errors[f"sweep {config.label}"] = f"{type(err).__name__}: {err}"
            return
        print(f"[llama-server] sweep {config.label}: {scores[config]:.1f} output tok/s",
              flush=True)

    for n in slots:
        one(ServerConfig(n, threads=threads, tier=tier))
    if scores and ubatches:
        best_slots = max(scores, key=lambda c: scores[c]).slots
        for ub in ubatches:
            one(ServerConfig(best_slots, ub, threads, tier))
    best = max(scores, key=lambda c: scores[c]) if scores else None
    return best, {c.label: v for c, v in scores.items()}
