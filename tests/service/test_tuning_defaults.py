"""Every scheduling default has one source, ``SchedulerTuning``: the ``kvfence serve`` flags,
``EngineSizing`` and ``EngineConfig`` agree with it field by field."""

from __future__ import annotations

import dataclasses

from service.engine.tuning import SchedulerTuning
from service.engine.types import EngineConfig
from service.serve import commands as cli
from service.serve.settings import EngineSizing, engine_config, serve_config

# flag dest / EngineSizing field -> SchedulerTuning field
FLAGS = {
    "max_num_batched_tokens": "max_num_batched_tokens",
    "max_step_ms": "max_step_ms",
    "decode_stretch": "decode_stretch",
    "prefill_chunk": "prefill_chunk",
}


def test_flags_serve_config_and_engine_config_share_the_tuning_defaults() -> None:
    tuning = SchedulerTuning()
    args = cli.parse_args(["serve"])
    sizing = serve_config(args).sizing
    for flag, field in FLAGS.items():
        want = getattr(tuning, field)
        assert getattr(args, flag) == want, f"--{flag.replace('_', '-')}"
        assert getattr(sizing, flag) == want, f"EngineSizing.{flag}"
        assert getattr(EngineSizing(), flag) == want, f"EngineSizing().{flag}"
    # The engine built from the served defaults, and a bare EngineConfig, hold the same
    # tuning in every field, including those no flag sets.
    assert engine_config(sizing, model_len=2048).tuning == tuning
    assert EngineConfig().tuning == tuning


def test_every_tuning_field_is_documented_for_operators() -> None:
    from tests.serverutil import ROOT

    text = (ROOT / "docs" / "scheduling.md").read_text(encoding="utf-8")
    missing = [f.name for f in dataclasses.fields(SchedulerTuning) if f"`{f.name}`" not in text]
    assert missing == []
