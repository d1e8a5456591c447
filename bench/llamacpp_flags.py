"""The CMake flags ``make bench`` builds llama.cpp (llama-cpp-python) with, for this CPU.

``python -m bench.llamacpp_flags`` prints them. The default is ``-DGGML_NATIVE=ON`` (every
instruction set the CPU has). On a CPU with AMX, the native build compiles ggml's AMX
matmul backend, which segfaults in ``ggml_backend_amx_mul_mat`` on the first batch of more
than one token here (SmolLM2-135M Q4_1, llama-cpp-python 0.3.36; upstream:
ggml-org/llama.cpp#20824, closed without a fix). There the build names the instruction sets
one by one instead, every one this CPU has except AMX.
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


def cpu_flags(cpuinfo: str) -> set[str]:
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def cmake_args(flags: set[str]) -> str:
    if not any(f.startswith("amx") for f in flags):
        return "-DGGML_NATIVE=ON"
    named = [f"-D{option}=ON" for flag, option in _GGML_OPTIONS if flag in flags]
    return " ".join(["-DGGML_NATIVE=OFF", *named, "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
                     "-DGGML_AMX_BF16=OFF"])


def main() -> None:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    print(cmake_args(cpu_flags(info)))


if __name__ == "__main__":
    main()
