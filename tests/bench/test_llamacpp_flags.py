"""The llama.cpp build flags ``make bench`` picks (bench/llamacpp_flags.py)."""

from __future__ import annotations

from bench.llamacpp_flags import cmake_args, cpu_flags, tier_args, tiers

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


ZEN2 = {"avx", "avx2", "fma", "f16c", "bmi2"}


def test_an_avx2_cpu_has_one_tier_and_a_wider_one_two() -> None:
    assert tiers(ZEN2) == ("native",)  # its native build is the AVX2 tier
    assert tiers(ZEN2 | {"avx512f"}) == ("native", "avx2")
    assert tiers(cpu_flags(AMX_CPU)) == ("native", "avx2")
    assert tiers(set()) == ("native",)


def test_the_avx2_peer_is_built_for_avx2_only() -> None:
    args = tier_args("avx2", cpu_flags(AMX_CPU)).split()
    assert "-DGGML_NATIVE=OFF" in args
    for option in ("AVX", "AVX2", "FMA", "F16C", "BMI2"):
        assert f"-DGGML_{option}=ON" in args
    for off in ("AVX512", "AVX_VNNI", "AMX_TILE", "AMX_INT8", "AMX_BF16"):
        assert f"-DGGML_{off}=OFF" in args
    assert not any("AVX512" in a and a.endswith("=ON") for a in args)
    assert tier_args("native", ZEN2) == "-DGGML_NATIVE=ON"
