"""The scale-out flags of ``kvfence serve``: parsed into ClusterLimitsConfig, bad values refused
in one line (exit 2) before any model loads, and the documented default failure mode."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.admission.cluster_limits import DEFAULT_FAILURE_MODE, ClusterLimitsConfig
from service.admission.tenants import add_tenant
from service.serve import commands as cli
from service.serve.settings import serve_config


def _parse(*argv: str) -> ClusterLimitsConfig | None:
    args = cli.parse_args(["serve", *argv])
    return serve_config(args).options.cluster_limits


def test_without_redis_url_limits_stay_local() -> None:
    assert _parse() is None


def test_redis_flags_build_the_cluster_limits_config() -> None:
    config = _parse(
        "--redis-url", "redis://10.0.0.5:6379/2",
        "--limits-on-redis-failure", "closed",
        "--stream-lease-ttl", "4",
    )
    assert config == ClusterLimitsConfig(
        redis_url="redis://10.0.0.5:6379/2", on_redis_failure="closed", lease_ttl_s=4.0
    )


def test_default_failure_mode_is_open_and_env_vars_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    assert DEFAULT_FAILURE_MODE == "open"
    assert _parse("--redis-url", "redis://r:6379/0") == ClusterLimitsConfig("redis://r:6379/0")
    monkeypatch.setenv("KVFENCE_REDIS_URL", "redis://env:6379/0")
    monkeypatch.setenv("KVFENCE_LIMITS_ON_REDIS_FAILURE", "closed")
    config = _parse()
    assert config is not None and config.redis_url == "redis://env:6379/0"
    assert config.on_redis_failure == "closed"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--redis-url", "localhost:6379"], "--redis-url"),
        (["--redis-url", "redis://r:6379/0", "--stream-lease-ttl", "0"], "lease TTL"),
    ],
)
def test_bad_redis_flags_are_one_line_and_exit_2(
    argv: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tenants = tmp_path / "tenants.toml"
    add_tenant(tenants, "a")
    assert cli.main(["serve", "--tenants", str(tenants), "--port", "0", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err


def test_unknown_failure_mode_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(
            ["serve", "--redis-url", "redis://r:6379/0", "--limits-on-redis-failure", "maybe"]
        )
    assert exit_info.value.code == 2
