"""Engine and cache configs are derived from the serve flags by one function each."""

from __future__ import annotations

import pytest

from service.app import EngineSizing, cache_config, engine_config


def test_engine_config_takes_the_models_length_unless_capped() -> None:
    sizing = EngineSizing(max_num_seqs=3, max_num_batched_tokens=64, warmup=False)
    cfg = engine_config(sizing, model_len=2048)
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len, cfg.warmup) == (
        3,
        64,
        2048,
        False,
    )
    assert engine_config(EngineSizing(max_model_len=512), model_len=2048).max_model_len == 512


def test_cache_config_carries_page_size_scrub_and_ttl() -> None:
    cfg = cache_config(EngineSizing(page_size=32, scrub_policy="always", prefix_ttl_s=5.0))
    assert (cfg.page_size, cfg.scrub_policy, cfg.default_ttl_s) == (32, "always", 5.0)
    with pytest.raises(ValueError):
        cache_config(EngineSizing(page_size=0))
