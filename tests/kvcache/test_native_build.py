"""The kernel cache nobody else can write (kvcache/native_build.py): owner-only directories,
a planted library never loaded (its constructor never runs), damaged entries rebuilt,
every failure one warning and the torch path, and no home directory still a kernel."""

from __future__ import annotations

import ctypes
import os
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import structlog

from kvcache import native_build

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")

PROBE = "int probe(void) { return 42; }\n"
# What an attacker plants: a constructor that runs at dlopen, and a probe() that answers 666.
PLANTED = """#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("ran", f); fclose(f); }
}
int probe(void) { return 666; }
"""


class Probe:
    """The test kernel's wrapper: resolving ``probe`` is what a missing symbol fails."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.value = int(lib.probe())


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A source file of its own and a fresh KVFENCE_HOME (not yet made): returns the home."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "probe.c").write_text(PROBE)
    home = tmp_path / "home"
    monkeypatch.setenv("KVFENCE_HOME", str(home))
    monkeypatch.delenv("KVFENCE_KERNEL_CFLAGS", raising=False)
    return home


def _load(tmp_path: Path) -> Probe | None:
    return native_build.load(tmp_path / "src" / "probe.c", "probe", Probe)


def _entry(home: Path) -> Path:
    (entry,) = (home / "kernels").glob("probe-*.so")
    return entry


def _plant(tmp_path: Path, at: Path, marker: Path, digest: bool) -> None:
    """Compile the planted library to ``at`` (with a matching digest beside it if asked)."""
    src = tmp_path / "planted.c"
    src.write_text(PLANTED)
    subprocess.run(
        ["cc", "-shared", "-fPIC", f'-DMARKER="{marker}"', str(src), "-o", str(at)], check=True
    )
    if digest:
        sidecar = at.with_name(at.name + ".sha256")
        sidecar.unlink(missing_ok=True)
        sidecar.write_bytes(native_build.sidecar(at.read_bytes()))
        sidecar.chmod(0o600)
    at.chmod(0o700)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_build_makes_owner_only_directories_and_files(env: Path, tmp_path: Path) -> None:
    kernel = _load(tmp_path)
    assert kernel is not None and kernel.value == 42
    entry = _entry(env)
    assert _mode(env) == 0o700 and _mode(env / "kernels") == 0o700
    assert _mode(entry) == 0o700 and entry.stat().st_uid == os.getuid()
    sidecar = entry.with_name(entry.name + ".sha256")
    assert _mode(sidecar) == 0o600
    assert sidecar.read_bytes() == native_build.sidecar(entry.read_bytes())
    leftovers = sorted(p.name for p in (env / "kernels").iterdir())
    assert leftovers == sorted([".lock", entry.name, sidecar.name])  # no temporary builds
    again = _load(tmp_path)  # a cache hit: the same entry, not rebuilt
    assert again is not None and again.value == 42 and _entry(env).stat().st_ino == entry.stat().st_ino


@pytest.mark.parametrize("how", ["other owner", "mode 0666", "symlink", "group-writable dir",
                                 "home of another owner"])
def test_a_planted_library_is_never_loaded(
    how: str, env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A library under the entry's name that someone else could have written (with a digest
    that matches it) is never dlopen-ed: its constructor does not run, the kernel is built
    privately instead (one warning) and it is the real one."""
    if how in ("other owner", "home of another owner") and os.getuid() != 0:
        pytest.skip("chown to another user needs root")
    assert _load(tmp_path) is not None
    entry = _entry(env)
    marker = tmp_path / "constructor-ran"
    target = tmp_path / "elsewhere.so" if how == "symlink" else entry
    entry.unlink()
    _plant(tmp_path, target, marker, digest=True)
    if how == "symlink":
        entry.symlink_to(target)
        entry.with_name(entry.name + ".sha256").write_bytes(native_build.sidecar(target.read_bytes()))
    elif how == "other owner":
        os.chown(entry, 65534, 65534)
    elif how == "mode 0666":
        entry.chmod(0o666)
    elif how == "group-writable dir":
        (env / "kernels").chmod(0o770)
    elif how == "home of another owner":
        os.chown(env, 65534, 65534)
    private = Path(os.environ.get("TMPDIR", "/tmp"))
    before = set(private.glob("kvfence-kernels-*"))
    with structlog.testing.capture_logs() as logs:
        kernel = _load(tmp_path)
    assert not marker.exists(), "the planted library's constructor ran"
    assert kernel is not None and kernel.value == 42
    assert [e["event"] for e in logs] == ["native_cache_untrusted"]
    assert set(private.glob("kvfence-kernels-*")) <= before  # the private build left nothing


def test_an_entry_whose_bytes_do_not_match_its_digest_is_never_loaded(
    env: Path, tmp_path: Path
) -> None:
    """Another library put in place of our own entry (owned by us, the old digest beside it)
    is deleted unloaded and rebuilt."""
    assert _load(tmp_path) is not None
    entry = _entry(env)
    sidecar = entry.with_name(entry.name + ".sha256").read_bytes()
    marker = tmp_path / "constructor-ran"
    entry.unlink()
    _plant(tmp_path, entry, marker, digest=False)
    with structlog.testing.capture_logs() as logs:
        kernel = _load(tmp_path)
    assert not marker.exists(), "a library that fails its digest was loaded"
    assert kernel is not None and kernel.value == 42
    assert entry.with_name(entry.name + ".sha256").read_bytes() == sidecar  # the same build again
    assert [e["event"] for e in logs] == ["native_kernel_rebuilt"]


@pytest.mark.parametrize("damage", ["truncated", "no digest", "missing symbol"])
def test_a_damaged_entry_is_rebuilt_once(damage: str, env: Path, tmp_path: Path) -> None:
    assert _load(tmp_path) is not None
    entry = _entry(env)
    good = entry.read_bytes()
    if damage == "truncated":
        _replace(entry, good[: len(good) // 2])
    elif damage == "no digest":
        entry.with_name(entry.name + ".sha256").unlink()
    else:  # a valid library and digest without the kernel's symbol
        src = tmp_path / "empty.c"
        src.write_text("int unrelated(void) { return 1; }\n")
        entry.unlink()
        subprocess.run(["cc", "-shared", "-fPIC", str(src), "-o", str(entry)], check=True)
        _plant_digest(entry)
    with structlog.testing.capture_logs() as logs:
        kernel = _load(tmp_path)
    assert kernel is not None and kernel.value == 42
    assert _entry(env).read_bytes() == good
    assert [e["event"] for e in logs] == ["native_kernel_rebuilt"]


def _replace(entry: Path, data: bytes) -> None:
    """Put ``data`` at ``entry`` as a new file: truncating the loaded library in place would
    pull the pages this process has mapped from under it (SIGBUS)."""
    fresh = entry.with_name(entry.name + ".new")
    fresh.write_bytes(data)
    fresh.chmod(0o700)
    os.replace(fresh, entry)


def _plant_digest(entry: Path) -> None:
    sidecar = entry.with_name(entry.name + ".sha256")
    sidecar.unlink()
    sidecar.write_bytes(native_build.sidecar(entry.read_bytes()))
    entry.chmod(0o700)
    sidecar.chmod(0o600)


def test_a_failed_build_is_one_warning_and_no_kernel(env: Path, tmp_path: Path) -> None:
    (tmp_path / "src" / "probe.c").write_text("int probe(void) { return }\n")
    with structlog.testing.capture_logs() as logs:
        assert _load(tmp_path) is None
    assert [(e["event"], e["log_level"]) for e in logs] == [("native_kernel_unavailable", "warning")]
    assert list((env / "kernels").glob("*.so")) == []


def test_another_openmp_runtime_keeps_the_torch_path(
    env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    maps = (
        "7f00-7f01 r-xp 0 08:01 1 /venv/torch/lib/libgomp.so.1\n"
        "7f02-7f03 r-xp 0 08:01 2 /venv/sentencepiece.libs/libgomp-6a29c32d.so.1.0.0\n"
    )
    assert native_build.foreign_openmp(maps) == []  # GNU runtimes only: the kernels' own
    intel = maps + "7f04-7f05 r-xp 0 08:01 3 /opt/intel/lib/libiomp5.so\n"
    assert native_build.foreign_openmp(intel) == ["/opt/intel/lib/libiomp5.so"]
    assert native_build.foreign_openmp(maps + "1-2 r-xp 0 0:1 4 /usr/lib/libomp.so.5\n")
    monkeypatch.setattr(native_build, "_maps", lambda: intel)
    with structlog.testing.capture_logs() as logs:
        assert _load(tmp_path) is None
    assert [e["event"] for e in logs] == ["native_kernel_unavailable"]
    assert "OpenMP" in logs[0]["reason"]
    monkeypatch.setattr(native_build, "_maps", lambda: maps)
    assert _load(tmp_path) is not None


def test_no_home_directory_builds_into_a_private_temporary_one(
    env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without HOME and without a passwd entry ``Path.home()`` raises RuntimeError; the
    kernel is still built (privately, left nowhere) instead of the error escaping."""
    import pwd

    for name in ("KVFENCE_HOME", "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(name, raising=False)

    def no_entry(uid: int) -> pwd.struct_passwd:
        raise KeyError(uid)

    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    with pytest.raises(RuntimeError):
        Path.home()
    assert native_build.cache_root() is None
    kernel = _load(tmp_path)
    assert kernel is not None and kernel.value == 42


def test_concurrent_builds_share_one_entry(env: Path, tmp_path: Path) -> None:
    """Processes starting together build under one lock: each loads a whole library and one
    entry is left."""
    code = (
        "import ctypes, sys\n"
        "from pathlib import Path\n"
        "from kvcache import native_build\n"
        "k = native_build.load(Path(sys.argv[1]), 'probe', lambda lib: int(lib.probe()))\n"
        "assert k == 42, k\n"
    )
    source = str(tmp_path / "src" / "probe.c")
    procs = [subprocess.Popen([sys.executable, "-c", code, source]) for _ in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    assert len(list((env / "kernels").glob("probe-*.so"))) == 1


def test_the_inductor_cache_is_private_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.engine.compiled import inductor_cache_dir

    monkeypatch.setenv("KVFENCE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    made = inductor_cache_dir()
    assert made == tmp_path / "home" / "inductor" and _mode(made) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(shared))
    with structlog.testing.capture_logs() as logs:
        private = inductor_cache_dir()
    assert private != shared and _mode(private) == 0o700 and private.stat().st_uid == os.getuid()
    assert [e["event"] for e in logs] == ["native_cache_untrusted"]
    shutil.rmtree(private)


def test_loading_is_once_per_process_even_from_threads(env: Path, tmp_path: Path) -> None:
    cache: dict[str, Probe | None] = {}
    lock = threading.Lock()
    results: list[Probe | None] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(
                native_build.load_once(cache, lock, tmp_path / "src" / "probe.c", "probe", Probe)
            )
        )
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and len({id(r) for r in results}) == 1 and results[0] is not None


def test_a_truncated_decode_kernel_is_rebuilt_and_attends(
    env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real kernel: its cache entry cut short (SIGBUS on every start when it was loaded
    raw) is rebuilt on the next start, which then computes what the first one did."""
    import torch

    from kvcache.backends import cpu_decode

    monkeypatch.setattr(cpu_decode, "_loaded", {})
    kernel = cpu_decode.kernel()
    assert kernel is not None
    torch.manual_seed(0)
    layer = torch.randn(4, 2, 16, 3, 64)
    q = torch.randn(1, 9, 64)
    plan = (torch.tensor([0, 2], dtype=torch.int32), torch.tensor([3, 1], dtype=torch.int32),
            torch.tensor([20], dtype=torch.int32))
    want = kernel.run(q, layer, *plan)
    (entry,) = (env / "kernels").glob("cpu_decode-*.so")
    whole = entry.read_bytes()
    _replace(entry, whole[:4096])
    monkeypatch.setattr(cpu_decode, "_loaded", {})  # a fresh start
    with structlog.testing.capture_logs() as logs:
        again = cpu_decode.kernel()
    assert again is not None and torch.equal(again.run(q, layer, *plan), want)
    assert entry.read_bytes() == whole
    assert [e["event"] for e in logs] == ["native_kernel_rebuilt"]


def test_a_change_to_an_included_file_builds_the_kernel_again(
    env: Path, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    (src / "parts").mkdir()
    (src / "parts" / "answer.h").write_text('#include "../value.h"\n')
    (src / "value.h").write_text("#define ANSWER 42\n")
    (src / "probe.c").write_text('#include "parts/answer.h"\nint probe(void) { return ANSWER; }\n')
    first = _load(tmp_path)
    assert first is not None and first.value == 42
    (src / "value.h").write_text("#define ANSWER 43\n")  # two includes down
    second = _load(tmp_path)
    assert second is not None and second.value == 43
    assert len(list((env / "kernels").glob("probe-*.so"))) == 2
    assert b"value.h\0#define ANSWER 43" in native_build.source_bytes(src / "probe.c")
