"""Per-tenant KV shares: derived from the pool and weights, refused when they cannot fit
(before the model's weights are read, where the flags and the model's header allow)."""

from __future__ import annotations

import asyncio
import io
from dataclasses import replace
from pathlib import Path

import pytest

from service.admission.kv_shares import KVShareError, kv_shares, tier_shares
from service.admission.tenants import Quotas, Tenant
from service.serve.app import check_shares_before_load
from service.serve.settings import ConfigError, ServeConfig, ServerOptions, serve_config


def _t(name: str, weight: float = 1.0, pages: int = 0) -> Tenant:
    return Tenant(name=name, weight=weight, quotas=Quotas(max_kv_pages=pages))


def _of(*tenants: Tenant) -> dict[str, Tenant]:
    return {t.name: t for t in tenants}


def test_default_shares_split_the_pool_by_weight() -> None:
    shares = kv_shares(_of(_t("a"), _t("b", 2.0), _t("c")), 100)
    assert shares == {"a": 25, "b": 50, "c": 25}
    assert sum(shares.values()) <= 100


def test_the_kv_tier_is_split_by_weight() -> None:
    shares = tier_shares(_of(_t("a"), _t("b", 2.0), _t("c", pages=7)), 1000)
    assert shares == {"a": 250, "b": 500, "c": 250}  # a page quota does not change it


def test_explicit_quotas_are_taken_first_and_the_rest_is_split() -> None:
    assert kv_shares(_of(_t("a", pages=40), _t("b"), _t("c", 3.0)), 100) == {
        "a": 40,
        "b": 15,
        "c": 45,
    }


def test_quotas_over_the_pool_are_refused_in_one_line() -> None:
    with pytest.raises(KVShareError) as info:
        kv_shares(_of(_t("a", pages=60), _t("b", pages=50)), 100)
    assert "add up to 110 pages but the KV pool has 100" in str(info.value)
    assert "--kv-overcommit" in str(info.value) and "\n" not in str(info.value)


def test_quotas_that_leave_nothing_for_the_others_are_refused() -> None:
    with pytest.raises(KVShareError, match="leave no KV pages for b"):
        kv_shares(_of(_t("a", pages=100), _t("b")), 100)


def test_overcommit_accepts_and_derived_tenants_split_the_whole_pool() -> None:
    shares = kv_shares(_of(_t("a", pages=90), _t("b", pages=90), _t("c")), 100, overcommit=True)
    assert shares == {"a": 90, "b": 90, "c": 100}


def test_server_refuses_to_start_with_shares_over_the_pool(
    tiny_model: object, tmp_path: Path
) -> None:
    from service.serve.app import ConfigError
    from service.serve.kvfence_server import ServerOptions
    from tests.serverutil import TenantSpec, running_server
    from tests.service.rpc import usage

    tenants = {"a": TenantSpec(max_kv_pages=1_000_000), "b": TenantSpec()}
    with (
        pytest.raises(ConfigError, match="add up to 1000000 pages"),
        running_server(tiny_model, tenants, tenants_dir=tmp_path),
    ):
        pass
    options = ServerOptions(kv_overcommit=True)
    with running_server(tiny_model, tenants, tenants_dir=tmp_path, options=options) as srv:
        pool = srv.stack.engine.num_pages
        assert usage(srv, "a").quotas.max_kv_pages == 1_000_000
        assert usage(srv, "b").quotas.max_kv_pages == pool  # derived: the whole pool


def test_default_shares_are_reported_by_get_usage(tiny_model: object, tmp_path: Path) -> None:
    from tests.serverutil import TenantSpec, running_server
    from tests.service.rpc import usage

    tenants = {"a": TenantSpec(weight=3.0), "b": TenantSpec(), "c": TenantSpec(max_kv_pages=8)}
    with running_server(tiny_model, tenants, tenants_dir=tmp_path) as srv:
        left = srv.stack.engine.num_pages - 8
        assert usage(srv, "a").quotas.max_kv_pages == left * 3 // 4
        assert usage(srv, "b").quotas.max_kv_pages == left // 4
        assert usage(srv, "c").quotas.max_kv_pages == 8


def _serve_config(model: Path, tenants: Path, *flags: str) -> ServeConfig:
    """``kvfence serve`` flags -> the ServeConfig the CLI would build."""
    from service.serve import commands as cli

    argv = ["serve", "--model", str(model), "--tenants", str(tenants), "--port", "0", *flags]
    return serve_config(cli.parse_args(argv))


@pytest.mark.parametrize("model_format", ["hf", "gguf"])
@pytest.mark.parametrize(
    ("kv_memory", "quota", "bound"),
    [("1MiB", 1_000_000, False), ("0.001", 4_000_000_000, True)],
)
def test_quotas_over_the_pool_are_refused_before_the_weights_load(
    tiny_llama_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    model_format: str,
    kv_memory: str,
    quota: int,
    bound: bool,
) -> None:
    from service.serve.app import serve
    from service.telemetry.logs import make_logger
    from tests.fixtures.tiny_gguf import write_gguf_from_hf
    from tests.serverutil import TenantSpec, write_tenants_file

    model = tiny_llama_dir
    if model_format == "gguf":
        model = write_gguf_from_hf(tiny_llama_dir, tmp_path / "tiny.gguf")

    tenants = tmp_path / "tenants.toml"
    write_tenants_file(tenants, {"a": TenantSpec(max_kv_pages=quota), "b": TenantSpec()})
    reads: list[object] = []

    def no_weights(*args: object, **kwargs: object) -> None:
        reads.append(args)
        raise AssertionError("the weights were read before the quotas were checked")

    monkeypatch.setattr("service.model.loader.build_weights", no_weights)
    config = _serve_config(model, tenants, "--kv-memory", kv_memory)
    with pytest.raises(ConfigError) as info:
        asyncio.run(serve(config, make_logger("json", io.StringIO())))
    message = str(info.value)
    assert reads == []
    assert f"max_kv_pages add up to {quota} pages but the KV pool has" in message
    assert "--kv-overcommit" in message and "\n" not in message
    assert (f"is the most --kv-memory {kv_memory} can hold" in message) is bound


def test_the_pool_sized_before_the_load_is_the_pool_the_server_builds(
    tiny_llama_dir: Path, tiny_model: object, tmp_path: Path
) -> None:
    from service.model import open_model
    from tests.serverutil import TEST_SIZING, TenantSpec, running_server

    header = open_model(tiny_llama_dir).config
    config = ServeConfig(str(tiny_llama_dir), tmp_path / "t.toml", ServerOptions(), TEST_SIZING)
    pages = check_shares_before_load(config, _of(_t("a", pages=1)), header)
    with pytest.raises(ConfigError, match=f"add up to {pages + 1} pages but the KV pool has {pages};"):
        check_shares_before_load(config, _of(_t("a", pages=pages + 1)), header)
    overcommit = replace(config, options=ServerOptions(kv_overcommit=True))
    assert check_shares_before_load(overcommit, _of(_t("a", pages=pages + 1)), header) == pages
    tenants = {"a": TenantSpec(max_kv_pages=pages)}
    with running_server(tiny_model, tenants, sizing=TEST_SIZING, tenants_dir=tmp_path) as srv:
        assert srv.engine.num_pages == pages
