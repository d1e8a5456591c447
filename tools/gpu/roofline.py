"""The HBM roofline of a decode step: the bytes it must read, over the measured bandwidth.

Decode at these batch sizes is memory bound: every step reads every weight once, plus each
sequence's KV cache, and writes one new K/V row per sequence. The fastest a step can be is
those bytes at the device's bandwidth, measured here (not the datasheet's) as a
device-to-device copy, counting bytes read plus bytes written, as KINDS.md does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from service.model.model_config import ModelConfig


def weight_bytes(config: ModelConfig, itemsize: int) -> int:
    """Bytes of weights a decode step reads: every matrix and norm, the LM head in full and
    one embedding row per token (counted as none: negligible)."""
    c = config
    per_layer = (
        c.hidden_size * (c.q_size + 2 * c.kv_size)  # qkv
        + c.q_size * c.hidden_size  # o
        + 3 * c.hidden_size * c.intermediate_size  # gate, up, down
        + 2 * c.hidden_size  # norms
    )
    head = c.vocab_size * c.hidden_size + c.hidden_size
    return itemsize * (c.num_layers * per_layer + head)


def kv_bytes_per_token(config: ModelConfig, itemsize: int) -> int:
    """K and V of one token across all layers."""
    return itemsize * 2 * config.num_layers * config.kv_size


def decode_step_bytes(config: ModelConfig, itemsize: int, kv_lens: Sequence[int]) -> int:
    """Bytes a decode step over sequences of ``kv_lens`` keys (new token included) moves."""
    per_token = kv_bytes_per_token(config, itemsize)
    return weight_bytes(config, itemsize) + per_token * (sum(kv_lens) + len(kv_lens))


def generation_bytes(
    config: ModelConfig, itemsize: int, batch: int, prompt_len: int, new_tokens: int
) -> int:
    """Bytes of the ``new_tokens - 1`` decode steps after the prefill (the first token
    comes from the prefill) of ``batch`` sequences of ``prompt_len`` prompt tokens."""
    return sum(
        decode_step_bytes(config, itemsize, [prompt_len + step] * batch)
        for step in range(1, new_tokens)
    )


@dataclass(frozen=True, slots=True)
class Bandwidth:
    bytes_per_s: float  # read + written
    copy_bytes: int
    seconds: float


def measure_bandwidth(device: torch.device, nbytes: int, repeats: int = 10) -> Bandwidth:
    """Mean of ``repeats`` copies of ``nbytes`` after two warm-ups; read + write counted."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(2):
        dst.copy_(src)
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    sync()
    seconds = (time.perf_counter() - start) / repeats
    return Bandwidth(2 * nbytes / seconds, nbytes, seconds)


def roofline_fraction(step_bytes: float, step_seconds: float, bandwidth: Bandwidth) -> float:
    """Achieved bytes/s over the measured bandwidth (1.0 = at the roofline)."""
    return step_bytes / step_seconds / bandwidth.bytes_per_s
