"""The llama.cpp peers' plumbing: the pinned version, the server's flags, the sweep, and
llama-batched-bench's output (bench/llama_server.py, bench/offline_llama.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import llama_server
from bench.llama_server import ServerConfig, pinned_version, sweep
from bench.offline_llama import parse_batched
from tools.llamacpp_build import TARGETS, up_to_date, wanted


def test_the_pin_is_read_from_the_bench_extra(tmp_path: Path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project.optional-dependencies]\n'
                         'bench = ["matplotlib>=3.8", "llama-cpp-python==0.3.36"]\n')
    assert pinned_version(pyproject) == "0.3.36"
    pyproject.write_text('[project.optional-dependencies]\nbench = ["llama-cpp-python>=0.3"]\n')
    with pytest.raises(ValueError, match="does not pin"):
        pinned_version(pyproject)


def test_the_repository_pins_the_version_make_peers_builds() -> None:
    assert pinned_version().count(".") == 2


def test_the_server_gets_a_context_per_slot_and_its_batch_sizes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(llama_server, "binary", lambda name, tier: tmp_path / tier / name)
    args = ServerConfig(slots=8, ubatch=256, threads=2).args(Path("m.gguf"), 9000)
    flags = dict(zip(args[1::2], args[2::2], strict=False))
    assert args[0] == str(tmp_path / "native" / "llama-server")
    avx2 = ServerConfig(slots=8, threads=2, tier="avx2")
    assert avx2.args(Path("m.gguf"), 9000)[0] == str(tmp_path / "avx2" / "llama-server")
    assert avx2.label == "llama-server np=8 ub=512 (avx2 build)"
    assert flags["-np"] == "8" and flags["-c"] == str(8 * llama_server.SLOT_CONTEXT)
    assert (flags["-b"], flags["-ub"], flags["-t"], flags["-tb"]) == ("2048", "256", "2", "2")
    assert flags["--port"] == "9000" and flags["-m"] == "m.gguf"
    assert ServerConfig(1, 4096).args(Path("m"), 1)[11:15] == ["-b", "4096", "-ub", "4096"]


def test_each_tier_has_its_own_build_folder_inside_the_versions(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVFENCE_HOME", str(tmp_path))
    native = llama_server.peer_root("0.3.36")
    assert native == tmp_path / "llama.cpp" / "0.3.36"
    assert llama_server.peer_root("0.3.36", "avx2") == native / "avx2"
    with pytest.raises(llama_server.PeerMissing, match="make peers"):
        llama_server.binary(llama_server.LLAMA_BENCH, "avx2")


def test_the_sweep_tries_batches_at_the_best_slot_count_and_keeps_failures_out() -> None:
    rates = {(1, 512): 50.0, (2, 512): 90.0, (4, 512): 80.0, (2, 256): 95.0, (2, 2048): 70.0}
    tried: list[tuple[int, int]] = []

    def measure(c: ServerConfig) -> float:
        tried.append((c.slots, c.ubatch))
        if c.slots == 8:
            raise RuntimeError("no memory")
        return rates[(c.slots, c.ubatch)]

    errors: dict[str, str] = {}
    best, found = sweep((1, 2, 4, 8), (256, 2048), 3, measure, errors)
    assert tried == [(1, 512), (2, 512), (4, 512), (8, 512), (2, 256), (2, 2048)]
    assert best == ServerConfig(2, 256, 3)
    assert found["llama-server np=2 ub=256"] == 95.0 and len(found) == 5
    assert errors == {"sweep llama-server np=8 ub=512": "RuntimeError: no memory"}


def test_a_sweep_where_nothing_ran_has_no_best() -> None:
    def fail(c: ServerConfig) -> float:
        raise OSError("gone")

    errors: dict[str, str] = {}
    assert sweep((1, 2), (256,), 1, fail, errors) == (None, {})
    assert len(errors) == 2


def test_a_build_is_redone_when_its_flags_or_binaries_change(tmp_path: Path) -> None:
    stamp = wanted("0.3.36", "-DGGML_NATIVE=ON")
    assert not up_to_date(tmp_path, stamp)
    (tmp_path / "bin").mkdir()
    for name in TARGETS:
        (tmp_path / "bin" / name).write_bytes(b"")
    (tmp_path / "build.json").write_text(json.dumps(stamp))
    assert up_to_date(tmp_path, stamp)
    assert not up_to_date(tmp_path, wanted("0.3.36", "-DGGML_NATIVE=OFF"))
    assert not up_to_date(tmp_path, wanted("0.3.35", "-DGGML_NATIVE=ON"))
    (tmp_path / "bin" / "llama-server").unlink()
    assert not up_to_date(tmp_path, stamp)


BATCHED_OUT = """main: n_kv_max = 4096, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0
{"n_kv_max": 4096, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 128, "tg": 64, "pl": 1, "n_kv": 192, "t_pp": 0.100000, "speed_pp": 1280.000000, "t_tg": 0.400000, "speed_tg": 160.000000, "t": 0.500000, "speed": 384.000000}
{"n_kv_max": 4096, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 128, "tg": 64, "pl": 4, "n_kv": 768, "t_pp": 0.400000, "speed_pp": 1280.000000, "t_tg": 0.600000, "speed_tg": 426.666667, "t": 1.000000, "speed": 768.000000}
llama_perf_context_print:        load time =      40.00 ms
"""


def test_batched_bench_rows_are_read_from_its_jsonl_lines() -> None:
    rows = parse_batched(BATCHED_OUT)
    assert [(r.parallel, r.prompt, r.output) for r in rows] == [(1, 128, 64), (4, 128, 64)]
    assert rows[1].decode_tok_s == pytest.approx(426.666667)
    # output tokens over prefill + decode time: 4 x 64 / 1.0 s
    assert rows[1].output_tok_s == pytest.approx(256.0)
    assert rows[0].as_dict()["output_tok_s"] == pytest.approx(128.0)
