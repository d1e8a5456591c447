"""Rotary position embedding tables (HF "rotate_half" layout) and the RoPE scaling rules
checkpoints name (``rope_type``), each the same arithmetic as transformers'."""

from __future__ import annotations

import math

import torch

from service.model.model_config import ModelConfig, RopeScaling


def _base(theta: float, d: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))


def inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` in float32, with the config's scaling applied."""
    d, s = config.head_dim, config.rope_scaling
    base = _base(config.rope_theta, d)
    if s is None or s.kind == "dynamic":  # dynamic NTK changes nothing within the served span
        return base
    if s.kind == "llama3":
        return _llama3_scale(base, s)
    if s.kind == "linear":
        return base / s.factor
    if s.kind == "yarn":
        return _yarn(config.rope_theta, d, s)
    if s.kind == "longrope":
        factors = torch.tensor(s.short_factor, dtype=torch.float32)
        return 1.0 / (factors * config.rope_theta ** (torch.arange(0, d, 2).float() / d))
    raise ValueError(f"unknown rope scaling {s.kind!r}")


def attention_factor(config: ModelConfig) -> float:
    """The scale yarn and longrope put on cos and sin (1.0 for every other rule)."""
    s = config.rope_scaling
    return 1.0 if s is None else s.attention_factor


def _llama3_scale(freqs: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Same piecewise rule as Meta's reference: long wavelengths are divided by `factor`,
    # short ones kept, and the band in between interpolated smoothly.
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / s.factor, freqs)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(theta: float, d: int, s: RopeScaling) -> torch.Tensor:
    # YaRN: frequencies above the beta_fast band keep their value, those below beta_slow are
    # interpolated by `factor`, with a linear ramp between.
    def correction_dim(rotations: float) -> float:
        return (d * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, d, 2).float() / d)
    extrapolation = 1 - ramp
    return (1.0 / (s.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def cos_sin_table(freqs: torch.Tensor, max_positions: int) -> torch.Tensor:
    """``[max_positions, 2, head_dim]`` float32: cos and sin, each duplicated over both halves."""
    t = torch.arange(max_positions, dtype=torch.int64).float()
    angles = torch.outer(t, freqs)
    emb = torch.cat([angles, angles], dim=-1)
    return torch.stack([emb.cos(), emb.sin()], dim=1)
