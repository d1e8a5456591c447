"""Rotary position embedding tables (HF "rotate_half" layout)."""

from __future__ import annotations

import math

import torch

from service.model.config import ModelConfig, RopeScaling


def inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` in float32, Llama-3 scaling applied if configured."""
    d = config.head_dim
    base = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if config.rope_scaling is None:
        return base
    return _llama3_scale(base, config.rope_scaling)


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


def cos_sin_table(freqs: torch.Tensor, max_positions: int) -> torch.Tensor:
    """``[max_positions, 2, head_dim]`` float32: cos and sin, each duplicated over both halves."""
    t = torch.arange(max_positions, dtype=torch.int64).float()
    angles = torch.outer(t, freqs)
    emb = torch.cat([angles, angles], dim=-1)
    return torch.stack([emb.cos(), emb.sin()], dim=1)
