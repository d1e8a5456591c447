"""The CMake flags ``make bench`` builds llama.cpp (llama-cpp-python) with, for this CPU.

``python -m bench.llamacpp_flags`` prints them. The default is ``-DGGML_NATIVE=ON`` (every
instruction set the CPU has). On a CPU with AMX, the native build compiles ggml's AMX
matmul backend, which segfaults in ``ggml_backend_amx_mul_mat`` on the first batch of more
than one token here (SmolLM2-135M Q4_1, llama-cpp-python 0.3.36; upstream:
ggml-org/llama.cpp#20824, closed without a fix). There the build names the instruction sets
one by one instead, every one this CPU has except AMX.

Each kernel tier kvfence ships (``KVFENCE_KERNEL_ISA``, kvcache/native_build.py) has a peer
built for the same instruction sets: the ``native`` tier's is the build above, and the
``avx2`` tier's names AVX, AVX2, FMA, F16C and BMI2 only (x86-64-v3, what kvfence's ``avx2``
build compiles for), AVX-512, VNNI and AMX off. :func:`tiers` lists the tiers a CPU has:
``avx2`` only where the CPU has more than AVX2 (elsewhere the native build is that tier).
"""

from __future__ import annotations

from pathlib import Path

# /proc/cpuinfo flag -> ggml's CMake option (GGML_NATIVE=OFF builds only what is named).
_GGML_OPTIONS = (
    ("avx", "GGML_AVX"),
    ("avx2", "GGML_AVX2"),
    ("avx_vnni", "GGML_AVX_VNNI"),
    ("fma", "GGML_FMA"),
    ("f16c", "GGML_F16C"),
    ("bmi2", "GGML_BMI2"),
    ("avx512f", "GGML_AVX512"),
    ("avx512vbmi", "GGML_AVX512_VBMI"),
    ("avx512_vnni", "GGML_AVX512_VNNI"),
    ("avx512_bf16", "GGML_AVX512_BF16"),
)

_AMX_OFF = ("-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")


def cpu_flags(cpuinfo: str) -> set[str]:
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def cmake_args(flags: set[str]) -> str:
    if not any(f.startswith("amx") for f in flags):
        return "-DGGML_NATIVE=ON"
    named = [f"-D{option}=ON" for flag, option in _GGML_OPTIONS if flag in flags]
    return " ".join(["-DGGML_NATIVE=OFF", *named, *_AMX_OFF])


AVX2_ONLY = ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
             "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX_VNNI=OFF",
             *_AMX_OFF)
_AVX2_TIER = {"avx", "avx2", "fma", "f16c", "bmi2"}
_WIDER = ("avx512f", "avx_vnni", "amx_tile")


def tiers(flags: set[str]) -> tuple[str, ...]:
    """The kernel tiers this CPU runs, each benchmarked against its own llama.cpp build."""
    if flags >= _AVX2_TIER and any(f in flags for f in _WIDER):
        return ("native", "avx2")
    return ("native",)


def tier_args(tier: str, flags: set[str]) -> str:
    """The CMake flags of ``tier``'s llama.cpp build."""
    if tier == "native":
        return cmake_args(flags)
    if tier == "avx2":
        return " ".join(AVX2_ONLY)
    raise ValueError(f"no llama.cpp build for tier {tier!r}: use one of native, avx2")


def this_cpu() -> set[str]:
    """/proc/cpuinfo's flags (empty where it cannot be read)."""
    try:
        return cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return set()


def main() -> None:
    print(cmake_args(this_cpu()))


if __name__ == "__main__":
    main()
