"""Builds the llama.cpp peers, ``llama-server``, ``llama-batched-bench`` and ``llama-bench``,
once per kernel tier of this CPU: ``make peers``.

    python -m tools.llamacpp_build [--jobs N] [--tier native|avx2 ...]

The source is the llama.cpp tree vendored by the llama-cpp-python sdist at the version the
``bench`` extra pins (``pip download --no-binary :all: --no-deps``), so the peers are the same
llama.cpp the extra installs, built with the same CPU flags (bench/llamacpp_flags.py), in
Release and statically linked. The binaries land in kvfence's user cache,
``~/.cache/kvfence/llama.cpp/<version>/bin/`` (bench.llama_server.peer_root), with a
``build.json`` naming the version and flags; a second call with the same pin and flags finds
them and builds nothing. Where the CPU has more than AVX2, a second build for AVX2 only
(bench.llamacpp_flags.tier_args: the peer of ``KVFENCE_KERNEL_ISA=avx2``) lands in
``<version>/avx2/bin/`` from the same source.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from bench.llama_server import BATCHED_BENCH, LLAMA_BENCH, SERVER, peer_root, pinned_version
from bench.llamacpp_flags import this_cpu, tier_args, tiers

TARGETS = (SERVER, BATCHED_BENCH, LLAMA_BENCH)
BASE_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_CURL=OFF",
)


def wanted(version: str, cpu_args: str) -> dict[str, object]:
    """What a build is keyed on: a stamp that differs in any field is rebuilt."""
    return {"llama_cpp_python": version, "cmake_args": [*BASE_ARGS, *cpu_args.split()],
            "targets": list(TARGETS)}


def up_to_date(root: Path, stamp: dict[str, object]) -> bool:
    built = root / "build.json"
    if not built.is_file() or not all((root / "bin" / t).is_file() for t in TARGETS):
        return False
    try:
        return bool(json.loads(built.read_text()) == stamp)
    except ValueError:
        return False


def vendored_source(root: Path, version: str) -> Path:
    """llama.cpp as the sdist vendors it, downloaded and unpacked once under ``root/src``."""
    src = root / "src"
    tree = src / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if (tree / "CMakeLists.txt").is_file():
        return tree
    src.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:",
                    "--no-deps", "-d", str(src), f"llama-cpp-python=={version}"], check=True)
    sdists = sorted(src.glob(f"llama_cpp_python-{version}.tar.gz"))
    if not sdists:
        raise SystemExit(f"kvfence: no llama-cpp-python {version} sdist in {src}")
    with tarfile.open(sdists[0]) as tar:
        tar.extractall(src, filter="data")
    if not (tree / "CMakeLists.txt").is_file():
        raise SystemExit(f"kvfence: the sdist has no vendor/llama.cpp at {tree}")
    return tree


def build(root: Path, tree: Path, cpu_args: str, jobs: int) -> None:
    out = root / "build"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    args = [*BASE_ARGS, *cpu_args.split()]
    subprocess.run(["cmake", "-S", str(tree), "-B", str(out), *generator, *args], check=True)
    subprocess.run(["cmake", "--build", str(out), "-j", str(jobs), "--target", *TARGETS],
                   check=True)
    (root / "bin").mkdir(exist_ok=True)
    for target in TARGETS:
        shutil.copy2(out / "bin" / target, root / "bin" / target)


def build_tier(version: str, tier: str, cpu_args: str, jobs: int) -> None:
    """One tier's peers, unless its stamp says they are built with these flags."""
    stamp = wanted(version, cpu_args)
    root = peer_root(version, tier)
    if up_to_date(root, stamp):
        print(f"kvfence: llama.cpp peers ({tier}) up to date in {root / 'bin'}")
        return
    root.mkdir(parents=True, exist_ok=True)
    build(root, vendored_source(peer_root(version), version), cpu_args, jobs)
    (root / "build.json").write_text(json.dumps(stamp, indent=1) + "\n")
    print(f"kvfence: built {', '.join(TARGETS)} ({tier}) into {root / 'bin'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.llamacpp_build", description=__doc__)
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs")
    flags = this_cpu()
    have = tiers(flags)
    parser.add_argument("--tier", action="append", choices=have,
                        help=f"build only this tier's peers (repeatable; default: {', '.join(have)})")
    args = parser.parse_args(argv)
    version = pinned_version()
    for tier in args.tier or have:
        build_tier(version, tier, tier_args(tier, flags), args.jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
