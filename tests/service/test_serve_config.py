"""The serve flags become one ServeConfig in one place; the engine and cache configs and the
KV budget are derived from it by one function each."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from service.admission.cluster_limits import ClusterLimitsConfig
from service.http.guard import HttpGuard
from service.serve.settings import (
    ConfigError,
    EngineSizing,
    KVBudget,
    ServeConfig,
    ServerOptions,
    TlsFiles,
    cache_config,
    engine_config,
    kv_budget,
    kv_tier,
    kv_tier_bytes,
    kv_tier_secret,
    serve_config,
)
from tools.configuration_doc import actions, commands


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
    cfg = cache_config(EngineSizing(page_size=32, scrub_policy="always", prefix_ttl_s=5.0), 6)
    assert (cfg.page_size, cfg.scrub_policy, cfg.default_ttl_s) == (32, "always", 5.0)
    assert cfg.shared_pages == 6
    with pytest.raises(ValueError):
        cache_config(EngineSizing(page_size=0))


def test_the_kv_tier_is_off_unless_a_directory_is_given(tmp_path: Path) -> None:
    assert kv_tier(EngineSizing()) is None
    tier = kv_tier(EngineSizing(kv_tier_dir=str(tmp_path / "tier"), kv_tier_bytes="1MiB"))
    assert tier is not None and tier.budget_bytes == 2**20
    assert stat.S_IMODE((tmp_path / "tier").stat().st_mode) == 0o700


def test_the_kv_tier_flags_are_checked_in_one_line(tmp_path: Path) -> None:
    secret = tmp_path / "tier.key"
    secret.write_bytes(b"0123456789abcdef\n")
    os.chmod(secret, 0o600)
    sizing = EngineSizing(kv_tier_dir=str(tmp_path / "t"), kv_tier_secret_file=str(secret))
    assert kv_tier_secret(sizing) == b"0123456789abcdef"
    assert kv_tier_bytes(sizing) == 2**30
    os.chmod(secret, 0o640)
    with pytest.raises(ConfigError, match="only its owner can read"):
        kv_tier_secret(sizing)
    secret.write_bytes(b"short")
    os.chmod(secret, 0o600)
    with pytest.raises(ConfigError, match="holds 5 bytes; use at least 16"):
        kv_tier_secret(sizing)
    with pytest.raises(ConfigError, match=r"--kv-tier-secret-file .*cannot read it"):
        kv_tier_secret(EngineSizing(kv_tier_secret_file=str(tmp_path / "absent")))
    with pytest.raises(ConfigError, match="--kv-tier-bytes: cannot parse 'lots'"):
        kv_tier_bytes(EngineSizing(kv_tier_bytes="lots"))
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    os.chmod(loose, 0o777)
    with pytest.raises(ConfigError, match=r"--kv-tier-dir .*group- or world-writable"):
        kv_tier(EngineSizing(kv_tier_dir=str(loose)))


# Every `kvfence serve` flag with a value other than its default.
EVERY_FLAG = [
    "--model", "m.gguf", "--revision", "v1.0", "--host", "0.0.0.0", "--port", "1234", "--tenants", "t.toml",
    "--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-client-ca", "ca.pem",
    "--metrics-port", "9100", "--metrics-host", "0.0.0.1", "--http-port", "8080",
    "--metrics-on-http",
    "--grace-seconds", "3", "--reflection", "--log-content", "--log-format", "json",
    "--kv-memory", "0.5", "--max-num-seqs", "7", "--max-num-batched-tokens", "99",
    "--max-model-len", "300", "--page-size", "8", "--dtype", "float16", "--device", "cuda:1",
    "--weights", "int8", "--batch-invariant", "on", "--compile", "on", "--scrub-policy", "always", "--prefix-ttl", "5",
    "--alert-tenant-kv-pages", "11", "--alert-request-kv-pages", "12", "--max-step-ms", "40",
    "--decode-stretch", "1.5", "--prefill-chunk", "64", "--kv-overcommit", "--redis-url", "redis://r:6379/0",
    "--limits-on-redis-failure", "closed", "--stream-lease-ttl", "4",
    "--http-max-per-peer", "500", "--http-peer-rate", "200",
    "--otlp-endpoint", "http://o:4317", "--max-lora-rank", "16", "--max-loras-per-tenant", "2",
    "--served-model-name", "smol", "--served-model-name", "smol-chat",
    "--kv-tier-dir", "/var/tier", "--kv-tier-bytes", "2GiB", "--kv-tier-secret-file", "s.key",
]


def test_serve_config_is_built_once_from_every_flag() -> None:
    from service.serve import commands as cli

    serve_parser = dict(commands(cli.build_parser()))["kvfence serve"]
    flags = {s for a in actions(serve_parser) for s in a.option_strings if s.startswith("--")}
    assert flags - {"--help"} == {a for a in EVERY_FLAG if a.startswith("--")}
    config = serve_config(cli.parse_args(["serve", *EVERY_FLAG]))
    assert config == ServeConfig(
        model="m.gguf",
        tenants=Path("t.toml"),
        log_format="json",
        revision="v1.0",
        options=ServerOptions(
            host="0.0.0.0",
            port=1234,
            tls=TlsFiles(Path("c.pem"), Path("k.pem"), Path("ca.pem")),
            grace_s=3.0,
            reflection=True,
            log_content=True,
            metrics_host="0.0.0.1",
            metrics_port=9100,
            alert_tenant_kv_pages=11,
            alert_request_kv_pages=12,
            kv_overcommit=True,
            http_port=8080,
            metrics_on_http=True,
            otlp_endpoint="http://o:4317",
            max_lora_rank=16,
            max_loras_per_tenant=2,
            served_model_names=("smol", "smol-chat"),
            cluster_limits=ClusterLimitsConfig("redis://r:6379/0", "closed", lease_ttl_s=4.0),
            http_guard=HttpGuard(max_per_peer=500, paced_per_s=200.0, paced_burst=400),
        ),
        sizing=EngineSizing(
            kv_memory="0.5",
            max_num_seqs=7,
            max_num_batched_tokens=99,
            max_model_len=300,
            page_size=8,
            dtype="float16",
            device="cuda:1",
            weights="int8",
            batch_invariant="on",
            compile="on",
            scrub_policy="always",
            prefix_ttl_s=5.0,
            max_step_ms=40.0,
            prefill_chunk=64,
            decode_stretch=1.5,
            kv_tier_dir="/var/tier",
            kv_tier_bytes="2GiB",
            kv_tier_secret_file="s.key",
        ),
    )
    assert kv_budget(config.sizing) == KVBudget(kv_fraction=0.5)
    assert kv_budget(EngineSizing(kv_memory="2KiB")) == KVBudget(kv_bytes=2048)


def test_the_scheduling_flags_reach_the_engine_tuning() -> None:
    sizing = EngineSizing(
        max_num_batched_tokens=99, max_step_ms=40.0, decode_stretch=1.5, prefill_chunk=64
    )
    tuning = engine_config(sizing, model_len=2048).tuning
    assert (
        tuning.max_num_batched_tokens, tuning.max_step_ms, tuning.decode_stretch,
        tuning.prefill_chunk,
    ) == (99, 40.0, 1.5, 64)


def test_batch_invariance_is_auto_by_default_for_serve_and_the_library() -> None:
    import inspect

    from service.model import load_model
    from service.serve import commands as cli

    assert EngineSizing().batch_invariant == "auto"
    assert serve_config(cli.parse_args(["serve"])).sizing.batch_invariant == "auto"
    default = inspect.signature(load_model).parameters["batch_invariant"].default
    assert default == EngineSizing().batch_invariant


def test_compile_reaches_the_engine_config_and_is_off_by_default() -> None:
    assert engine_config(EngineSizing(compile="auto"), model_len=2048).compile == "auto"
    assert engine_config(EngineSizing(), model_len=2048).compile == "off"


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_bad_decode_stretch_is_refused_in_one_line(value: str) -> None:
    from service.serve import commands as cli
    from service.serve.preflight import check_fair_compute
    from service.serve.settings import ConfigError

    config = serve_config(cli.parse_args(["serve", "--decode-stretch", value]))
    with pytest.raises(ConfigError, match="--decode-stretch must be a number >= 0"):
        check_fair_compute(config)


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_bad_max_step_ms_is_refused_in_one_line(value: str) -> None:
    from service.serve import commands as cli
    from service.serve.preflight import check_fair_compute
    from service.serve.settings import ConfigError

    config = serve_config(cli.parse_args(["serve", "--max-step-ms", value]))
    with pytest.raises(ConfigError, match="--max-step-ms must be a number >= 0"):
        check_fair_compute(config)


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--http-max-per-peer", "0", "--http-max-per-peer must be at least 1"),
        ("--http-peer-rate", "0", "--http-peer-rate must be a number above 0"),
        ("--http-peer-rate", "nan", "--http-peer-rate must be a number above 0"),
        ("--http-peer-rate", "inf", "--http-peer-rate must be a number above 0"),
    ],
)
def test_bad_http_connection_bounds_are_refused_in_one_line(flag: str, value: str, says: str) -> None:
    from service.serve import commands as cli
    from service.serve.settings import ConfigError

    with pytest.raises(ConfigError) as err:
        serve_config(cli.parse_args(["serve", flag, value]))
    assert str(err.value) == says
