"""Per-tenant KV shares: derived from the pool and weights, refused when they cannot fit."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.kv_shares import KVShareError, kv_shares
from service.tenants import Quotas, Tenant


def _t(name: str, weight: float = 1.0, pages: int = 0) -> Tenant:
    return Tenant(name=name, weight=weight, quotas=Quotas(max_kv_pages=pages))


def _of(*tenants: Tenant) -> dict[str, Tenant]:
    return {t.name: t for t in tenants}


def test_default_shares_split_the_pool_by_weight() -> None:
    shares = kv_shares(_of(_t("a"), _t("b", 2.0), _t("c")), 100)
    assert shares == {"a": 25, "b": 50, "c": 25}
    assert sum(shares.values()) <= 100


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
    from service.app import ConfigError
    from service.grpc_server import ServerOptions
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
