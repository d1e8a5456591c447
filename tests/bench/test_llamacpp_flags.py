"""The llama.cpp build flags ``make bench`` picks (bench/llamacpp_flags.py)."""

from __future__ import annotations

from bench.llamacpp_flags import cmake_args, cpu_flags

AMX_CPU = "processor\t: 0\nflags\t\t: fpu avx avx2 fma f16c bmi2 avx512f avx512vbmi avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8\n"


def test_without_amx_the_build_is_native() -> None:
    assert cmake_args({"avx2", "avx512f", "avx512_bf16"}) == "-DGGML_NATIVE=ON"


def test_with_amx_every_set_but_amx_is_named() -> None:
    args = cmake_args(cpu_flags(AMX_CPU)).split()
    assert "-DGGML_NATIVE=OFF" in args
    for option in ("AVX", "AVX2", "FMA", "F16C", "BMI2", "AVX512", "AVX512_VBMI",
                   "AVX512_VNNI", "AVX512_BF16"):
        assert f"-DGGML_{option}=ON" in args
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(args)
    assert not any(a.startswith("-DGGML_AMX") and a.endswith("=ON") for a in args)
    assert "-DGGML_AVX_VNNI=ON" not in args  # the CPU does not list avx_vnni


def test_no_flags_line_means_no_amx() -> None:
    assert cpu_flags("processor\t: 0\n") == set()
    assert cmake_args(set()) == "-DGGML_NATIVE=ON"
