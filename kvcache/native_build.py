"""Native kernels built from C source on first use, into a cache nobody else can write.

Contract of :func:`load_once` (every C kernel kvfence compiles goes through it):

- the library is built with the system C compiler (``$CC``, else ``cc``) into
  ``$KVFENCE_HOME/kernels`` (else ``$XDG_CACHE_HOME/kvfence/kernels``, else
  ``~/.cache/kvfence/kernels``), keyed by the source, the compiler, the flags and the CPU's;
- directories it creates are 0700; a cache directory, or any directory above it, that is not
  owned by this user (or root) or is writable by group or others (without the sticky bit) is
  not used: the kernel is built into a fresh private directory instead, with one warning;
- an entry is opened without following links and is loaded only when it is a regular file
  owned by this user, writable by nobody else, whose bytes match the sha256 recorded beside
  it when it was built; so a planted, truncated or otherwise damaged ``.so`` is never
  ``dlopen``-ed (a truncated one would raise SIGBUS while loading);
- builds are written to a private temporary directory, fsynced, and renamed into place under
  an ``flock`` of the cache directory; a damaged entry (bytes or a missing symbol) is
  deleted and built again once;
- any failure answers None with one warning, and the caller runs its torch path.

NOTE: the kernels are built at run time rather than at install time because ``-march=native``
(AVX-512, AMX, VNNI where the host has them) is measured into the decode figures, and a
wheel built for one x86-64 level would give that up or need per-function dispatch in every
kernel. ``KVFENCE_KERNEL_ISA`` (``native`` | ``avx2`` | ``portable``) forces a level and
``KVFENCE_KERNEL_CFLAGS`` adds compiler flags (the sanitizer run); both are part of the key.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import re
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TypeVar

import structlog

log = structlog.get_logger(__name__)

K = TypeVar("K")

# NOTE: not -ffast-math: linking a shared library with it sets flush-to-zero for the process,
# and a request's temperature of 1e-45 then read as 0 (greedy) instead of being refused.
FLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC")
# KVFENCE_KERNEL_ISA -> -march: AVX2 + FMA + F16C without AVX-512 or VNNI, and plain x86-64.
ISAS = {"native": "native", "avx2": "x86-64-v3", "portable": "x86-64"}
# OpenMP runtimes other than GNU's (the kernels link libgomp, as torch's Linux wheels do).
_FOREIGN_OPENMP = ("libiomp5", "libiomp", "libomp.so", "libomp-")


class KernelBuildError(RuntimeError):
    """A kernel could not be built or loaded; the message says why."""


def switched_off() -> bool:
    """``KVFENCE_CPU_KERNEL=off`` switches every native CPU kernel off (the torch paths run)."""
    return os.environ.get("KVFENCE_CPU_KERNEL", "auto").lower() in ("off", "0", "false", "no")


# CPU flags of the AVX2 build's instruction set, and those beyond it: a CPU with both runs
# two different builds (native, and avx2 forced), a CPU with AVX2 alone one.
_AVX2_FLAGS = frozenset({"avx", "avx2", "fma", "f16c"})
_WIDER_FLAGS = ("avx512f", "avx_vnni", "amx_tile")


def tiers(cpu_flags: str | None = None) -> tuple[str, ...]:
    """The kernel builds (``KVFENCE_KERNEL_ISA`` values) that run different code on this CPU
    (``cpu_flags``: /proc/cpuinfo's flags line, this machine's by default): ``native``;
    ``avx2`` where the CPU has AVX2 and more (AVX-512, AVX-VNNI, AMX), so the two differ;
    and ``portable`` (plain x86-64), which every x86-64 CPU runs."""
    flags = set((_cpu_flags() if cpu_flags is None else cpu_flags).split())
    wider = flags >= _AVX2_FLAGS and any(f in flags for f in _WIDER_FLAGS)
    return ("native", "avx2", "portable") if wider else ("native", "portable")


def march() -> str:
    """The ``-march`` of this process's builds, from ``KVFENCE_KERNEL_ISA`` (default native)."""
    isa = (os.environ.get("KVFENCE_KERNEL_ISA") or "native").lower()  # empty: the default
    if isa not in ISAS:
        raise KernelBuildError(f"KVFENCE_KERNEL_ISA={isa!r}: use one of {', '.join(ISAS)}")
    return ISAS[isa]


def extra_flags() -> tuple[str, ...]:
    """``KVFENCE_KERNEL_CFLAGS``, split as a shell would."""
    return tuple(shlex.split(os.environ.get("KVFENCE_KERNEL_CFLAGS", "")))


def compile_library(
    compiler: str, source: Path, target: Path, arch: str = "native", extra: tuple[str, ...] = ()
) -> None:
    """Build the C file ``source`` into the shared library ``target`` for ``-march=arch``
    (the SIMD paths where it has them, plain C loops elsewhere)."""
    subprocess.run(
        [compiler, *FLAGS, *extra, f"-march={arch}", str(source), "-o", str(target), "-lm"],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )


def foreign_openmp(maps: str) -> list[str]:
    """The non-GNU OpenMP runtimes among the files mapped in ``maps`` (``/proc/self/maps``)."""
    found = set()
    for line in maps.splitlines():
        name = line.rsplit("/", 1)[-1] if "/" in line else ""
        if name.startswith(_FOREIGN_OPENMP):
            found.add(line.split()[-1])
    return sorted(found)


def _maps() -> str:
    try:
        return Path("/proc/self/maps").read_text()
    except OSError:
        return ""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def cache_root() -> Path | None:
    """``$KVFENCE_HOME``, else ``$XDG_CACHE_HOME/kvfence``, else ``~/.cache/kvfence``; None
    where there is no home directory to find (no ``HOME`` and no passwd entry)."""
    if home := os.environ.get("KVFENCE_HOME"):
        return Path(home)
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg) / "kvfence"
    try:
        return Path.home() / ".cache" / "kvfence"
    except (RuntimeError, KeyError, OSError):
        return None


def untrusted_reason(path: Path) -> str | None:
    """Why the directory ``path`` (and every directory above it) could have been written by
    another user, or None: each must be owned by this user or root and not writable by group
    or others, except a sticky directory (``/tmp``) above ``path``."""
    uid = os.getuid()
    real = Path(os.path.realpath(path))
    for at in (real, *real.parents):
        st = os.lstat(at)
        if not stat.S_ISDIR(st.st_mode):
            return f"{at} is not a directory"
        if st.st_uid not in (uid, 0) or (at == real and st.st_uid != uid):
            return f"{at} is owned by uid {st.st_uid}"
        if st.st_mode & 0o022 and not (at != real and st.st_mode & stat.S_ISVTX):
            return f"{at} is writable by group or others (mode {st.st_mode & 0o7777:o})"
    return None


def private_dir(name: str, configured: Path | None = None) -> Path:
    """A directory only this user can write, for a cache called ``name``: ``configured`` or
    ``cache_root() / name``, made 0700 where missing; a fresh private temporary directory
    (with one warning) where that one is not trusted or cannot be made."""
    wanted = configured if configured is not None else _under_root(name)
    if wanted is not None:
        try:
            _make_private(wanted)
            reason = untrusted_reason(wanted)
        except OSError as err:
            reason = str(err)
        if reason is None:
            return wanted
        log.warning("native_cache_untrusted", cache=name, path=str(wanted), reason=reason)
    return Path(tempfile.mkdtemp(prefix=f"kvfence-{name}-"))


def _under_root(name: str) -> Path | None:
    root = cache_root()
    return None if root is None else root / name


def _make_private(path: Path) -> None:
    """Create ``path`` and its missing parents, each 0700."""
    missing = []
    at = path
    while not os.path.lexists(at):
        missing.append(at)
        at = at.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            continue
        os.chmod(directory, 0o700)  # the umask may have taken bits, never added them


def load_once(
    cache: dict[str, K | None],
    lock: threading.Lock,
    source: Path,
    stem: str,
    wrap: Callable[[ctypes.CDLL], K],
) -> K | None:
    """``wrap`` of the library built from ``source``, built and loaded once per process and
    kept in ``cache``; None (with one warning) where it cannot be built or loaded, where
    another OpenMP runtime is in the process, or where native kernels are switched off."""
    if switched_off():
        return None
    with lock:
        if "kernel" not in cache:
            cache["kernel"] = load(source, stem, wrap)
        return cache["kernel"]


def load(source: Path, stem: str, wrap: Callable[[ctypes.CDLL], K]) -> K | None:
    """One attempt at :func:`load_once`'s contract, uncached."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.info("native_kernel_unavailable", kernel=stem, reason="no C compiler")
        return None
    if foreign := foreign_openmp(_maps()):
        log.warning(
            "native_kernel_unavailable", kernel=stem,
            reason=f"another OpenMP runtime is loaded ({', '.join(foreign)})",
        )
        return None
    try:
        return _Build(compiler, source, stem).load(wrap)
    except Exception as err:  # any failure: the torch path, with one warning
        detail = getattr(err, "stderr", "") or str(err)
        log.warning("native_kernel_unavailable", kernel=stem, reason=str(detail).strip()[:300])
        return None


_LOCAL_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def source_bytes(source: Path) -> bytes:
    """``source`` and every file it includes with quotes, recursively (each once, in the
    order first reached, its path beside its bytes): what a build's key covers, so a change
    to any header the kernel is built from builds it again."""
    seen: list[Path] = []

    def visit(path: Path) -> None:
        path = path.resolve()
        if path in seen:
            return
        seen.append(path)
        for name in _LOCAL_INCLUDE.findall(path.read_bytes()):
            visit(path.parent / name.decode())

    visit(source)
    root = source.resolve().parent
    return b"".join(
        str(p.relative_to(root) if p.is_relative_to(root) else p).encode() + b"\0" + p.read_bytes()
        for p in seen
    )


class _Build:
    """One kernel's cache entry: ``<stem>-<key>.so`` and its ``.sha256`` beside it."""

    def __init__(self, compiler: str, source: Path, stem: str) -> None:
        self.compiler, self.source = compiler, source
        self.arch, self.extra = march(), extra_flags()
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
        built_by = "\n".join([version, *FLAGS, *self.extra, self.arch, _cpu_flags()])
        key = hashlib.sha256(source_bytes(source) + built_by.encode()).hexdigest()[:16]
        self.name = f"{stem}-{key}.so"

    def load(self, wrap: Callable[[ctypes.CDLL], K]) -> K:
        directory = _under_root("kernels")
        if directory is not None:
            try:
                _make_private(directory)
                reason = untrusted_reason(directory)
            except OSError as err:
                reason = str(err)
            if reason is None:
                with _flocked(directory):
                    found = self._cached(directory / self.name, wrap)
                    if not isinstance(found, str):
                        return found[0]
                    if found != "untrusted":  # missing, or damaged and deleted
                        return self._build(directory, wrap)
                    reason = f"{directory / self.name} is not this user's private file"
            log.warning("native_cache_untrusted", cache="kernels", path=str(directory), reason=reason)
        private = Path(tempfile.mkdtemp(prefix="kvfence-kernels-"))
        try:
            return self._build(private, wrap)
        finally:
            shutil.rmtree(private, ignore_errors=True)

    def _cached(self, path: Path, wrap: Callable[[ctypes.CDLL], K]) -> tuple[K] | str:
        """(the loaded kernel,), or "missing", "untrusted" (left alone), "damaged" (deleted)."""
        data = _read_private(path)
        digest = _read_private(path.with_name(path.name + ".sha256"))
        if data is None:
            return "missing"
        if isinstance(data, str) or isinstance(digest, str):
            return "untrusted"
        if digest is None or data[:4] != b"\x7fELF" or sidecar(data) != digest:
            log.warning("native_kernel_rebuilt", path=str(path), reason="damaged entry")
            _delete(path)
            return "damaged"
        try:
            return (wrap(ctypes.CDLL(str(path))),)
        except (OSError, AttributeError) as err:
            log.warning("native_kernel_rebuilt", path=str(path), reason=str(err)[:200])
            _delete(path)
            return "damaged"

    def _build(self, directory: Path, wrap: Callable[[ctypes.CDLL], K]) -> K:
        """Compile into a private temporary directory under ``directory``, load it from
        there (a name no earlier ``dlopen`` in this process used), then rename it into
        place with its digest."""
        tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=directory))
        try:
            built = tmp / self.name
            compile_library(self.compiler, self.source, built, self.arch, self.extra)
            os.chmod(built, 0o700)
            data = built.read_bytes()
            _write_synced(built.with_name(built.name + ".sha256"), sidecar(data))
            with open(built, "rb") as f:
                os.fsync(f.fileno())
            kernel = wrap(ctypes.CDLL(str(built)))
            target = directory / self.name
            os.replace(built.with_name(built.name + ".sha256"), target.with_name(target.name + ".sha256"))
            os.replace(built, target)
            _fsync_dir(directory)
            return kernel
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def sidecar(data: bytes) -> bytes:
    """The ``.sha256`` file written beside a built library: its digest and length."""
    return f"{hashlib.sha256(data).hexdigest()} {len(data)}\n".encode()


def _read_private(path: Path) -> bytes | str | None:
    """The bytes of ``path``; None where it does not exist; a reason where it is a link, not
    a regular file, not this user's, or writable by group or others."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as err:  # ELOOP: a symbolic link
        return f"{path}: {err.strerror}"
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            return f"{path} is not this user's private file"
        return f.read()


def _write_synced(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _delete(path: Path) -> None:
    for p in (path, path.with_name(path.name + ".sha256")):
        with suppress(FileNotFoundError):
            os.unlink(p)


@contextmanager
def _flocked(directory: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``directory/.lock``: one build or check at a time, across
    processes."""
    fd = os.open(
        directory / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
    )
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
