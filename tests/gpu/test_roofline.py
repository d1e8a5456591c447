"""Roofline arithmetic and the greedy comparison rule of the GPU check."""

from __future__ import annotations

import pytest
import torch

from tools.gpu.greedy import compare
from tools.gpu.models import LLAMA_31_8B, model_config
from tools.gpu.roofline import (
    Bandwidth,
    decode_step_bytes,
    generation_bytes,
    kv_bytes_per_token,
    measure_bandwidth,
    roofline_fraction,
    weight_bytes,
)

CFG = model_config(LLAMA_31_8B, 4096)


def test_llama_31_8b_weight_bytes() -> None:
    # 8,030,261,248 parameters, less the embedding table (one row per token is read).
    assert weight_bytes(CFG, 2) == 2 * (8_030_261_248 - 128256 * 4096)


def test_kv_and_step_bytes() -> None:
    assert kv_bytes_per_token(CFG, 2) == 2 * 2 * 32 * 8 * 128  # 128 KiB
    per = kv_bytes_per_token(CFG, 2)
    # Two sequences whose steps attend over 100 and 200 keys, each writing one new row.
    assert decode_step_bytes(CFG, 2, [100, 200]) == weight_bytes(CFG, 2) + per * 302
    assert generation_bytes(CFG, 2, 2, 10, 3) == (
        decode_step_bytes(CFG, 2, [11, 11]) + decode_step_bytes(CFG, 2, [12, 12])
    )


def test_roofline_fraction() -> None:
    bw = Bandwidth(bytes_per_s=4e12, copy_bytes=1, seconds=1.0)
    # 16 GB in 8 ms is 2 TB/s: half of 4 TB/s.
    assert roofline_fraction(16e9, 8e-3, bw) == pytest.approx(0.5)


def test_measured_bandwidth_counts_read_and_write() -> None:
    bw = measure_bandwidth(torch.device("cpu"), 1 << 20, repeats=2)
    assert bw.bytes_per_s == pytest.approx(2 * (1 << 20) / bw.seconds)
    assert bw.bytes_per_s > 0


def test_compare_near_tie_rule() -> None:
    ref, gaps = [1, 2, 3, 4], [1.0, 1.0, 1e-4, 1.0]
    assert compare(ref, gaps, [1, 2, 3, 4], 1e-3).identical
    tie = compare(ref, gaps, [1, 2, 9, 9], 1e-3)
    assert (tie.ok, tie.near_tie_at, tie.identical) == (True, 2, False)
    bad = compare(ref, gaps, [1, 9, 3, 4], 1e-3)
    assert (bad.ok, bad.mismatched) == (False, 1)
    assert compare(ref, gaps, [1, 2, 3], 1e-3).mismatched == 1
