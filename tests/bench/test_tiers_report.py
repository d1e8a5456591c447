"""The tiers suite's plumbing: llama-bench's JSON read, and each tier and model's ratios
judged on the worst run, the roofline only on the native tier (bench/tiers.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from bench import tiers
from bench.llama_server import ServerConfig


def test_llama_bench_gives_pp512_tg_and_the_model_size(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: list[list[str]] = []
    rows = [{"n_prompt": 512, "n_gen": 0, "avg_ts": 256.0, "model_size": 90},
            {"n_prompt": 0, "n_gen": 128, "avg_ts": 100.0, "model_size": 90}]

    def fake_run(args: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        seen.append(args)
        return subprocess.CompletedProcess(args, 0, json.dumps(rows), "")

    monkeypatch.setattr(tiers.llama_server, "binary", lambda name, tier: tmp_path / tier / name)
    monkeypatch.setattr(tiers.subprocess, "run", fake_run)
    got = tiers.llama_bench(Path("m.gguf"), "avx2", 2, 5, 128)
    assert got == {"pp_tok_s": 256.0, "tg_tok_s": 100.0, "model_bytes": 90}
    flags = dict(zip(seen[0][1::2], seen[0][2::2], strict=False))
    assert seen[0][0] == str(tmp_path / "avx2" / "llama-bench")
    assert (flags["-p"], flags["-n"], flags["-r"], flags["-t"]) == ("512", "128", "5", "2")


def test_a_failed_llama_bench_is_an_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tiers.llama_server, "binary", lambda name, tier: Path(name))
    monkeypatch.setattr(tiers.subprocess, "run", lambda args, **_: subprocess.CompletedProcess(
        args, 1, "", "error: failed to load model\n"))
    with pytest.raises(RuntimeError, match=r"llama-bench exited with 1.*failed to load"):
        tiers.llama_bench(Path("m.gguf"), "native", 2, 5, 128)


def _ours(decode: float, ttft: float, offline: float) -> dict[str, Any]:
    return {"decode_tok_s": decode, "ttft_s": ttft, "offline_tok_s": offline,
            "offline_two_tenants_tok_s": offline * 0.96, "weight_bytes": 100, "stack": True,
            "dense_dtype": "torch.float32"}


def _theirs(tg: float, pp: float, offline: float) -> dict[str, Any]:
    return {"tg_tok_s": tg, "pp_tok_s": pp, "model_bytes": 110, "offline_tok_s": offline}


def test_targets_are_each_cases_worst_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(tiers, "machine_info", lambda threads: {})
    cases = [tiers.Case("native", "m", Path("m.gguf")), tiers.Case("avx2", "m", Path("m.gguf"))]
    got = {
        "native, m": {"kvfence": [_ours(120, 0.5, 300), _ours(110, 0.6, 320), _ours(130, 0.4, 310)],
                      "llama": [_theirs(100, 1024, 100), _theirs(100, 1024, 150),
                                _theirs(100, 1024, 120)]},
        "avx2, m": {"kvfence": [_ours(100, 0.5, 300)] * 3,
                    "llama": [_theirs(100, 512, 100)] * 3},
    }
    best = {c.label: ServerConfig(8, tier=c.tier) for c in cases}
    data = tiers.report(tmp_path, True, 2, 1000.0, cases, got, {}, best, {})
    targets = {t["name"].split(" (worst")[0]: t for t in data["targets"]}
    assert targets["native, m: decode / llama.cpp tg128"]["value"] == pytest.approx(1.1)
    assert targets["native, m: TTFT(512) / llama.cpp pp512"]["value"] == pytest.approx(1.2)
    assert not targets["native, m: TTFT(512) / llama.cpp pp512"]["passed"]
    assert targets["native, m: offline 64 / llama-server"]["value"] == pytest.approx(320 / 150)
    # 110 tok/s x the file's 110 bytes over 1000 bytes/s, its worst run
    assert targets["native, m: decode / memory roofline"]["value"] == pytest.approx(12.1)
    assert "avx2, m: decode / memory roofline" not in targets  # judged on the native tier only
    assert targets["avx2, m: TTFT(512) / llama.cpp pp512"]["value"] == pytest.approx(0.5)
    assert targets["avx2, m: decode / llama.cpp tg128"]["passed"] is False
    assert data["figures"]["avx2, m"]["llama_server_best"] == "llama-server np=8 ub=512 (avx2 build)"
    assert targets["native, m: offline 64, two tenants / one tenant"]["value"] == pytest.approx(0.96)
    assert targets["avx2, m: offline 64, two tenants / one tenant"]["passed"] is True
    assert "| native, m |" in (tmp_path / "tiers.md").read_text()
