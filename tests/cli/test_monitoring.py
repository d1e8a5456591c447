"""deploy/monitoring/: every kvfence metric the Grafana dashboard and the Prometheus alert
rules name is one a real server exports (scraped from `kvfence serve --metrics-port 0`)."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from clients import Client
from tests.cli.conftest import clean_env
from tests.serverutil import TenantSpec, start_server_process, write_tenants_file

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
METRIC = re.compile(r"\bkvfence_[a-z0-9_]+")
# The sample names each exposition type adds to its family name.
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",),
            "histogram": ("_bucket", "_sum", "_count", "_created")}


def exported_names(exposition: str) -> set[str]:
    names = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split()
            # A labelled counter with no samples yet is typed by its sample name.
            family = family.removesuffix("_total") if kind == "counter" else family
            names |= {family + suffix for suffix in SUFFIXES[kind]}
    return names


@pytest.fixture(scope="module")
def exported(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    tenants = tmp_path_factory.mktemp("monitoring") / "tenants.toml"
    keys = write_tenants_file(tenants, {"acme": TenantSpec()})
    process = start_server_process(tiny_llama_dir, tenants, ["--metrics-port", "0"],
                                   env=clean_env())
    try:
        with Client(process.target, api_key=keys["acme"]) as client:
            client.generate_text("hello", max_tokens=2, timeout=60)
        url = f"http://127.0.0.1:{process.metrics_port}/metrics"
        deadline = time.monotonic() + 30
        while True:  # the KV families appear once the server has snapshotted the cache
            with urllib.request.urlopen(url, timeout=10) as answer:
                names = exported_names(answer.read().decode())
            if "kvfence_kv_pages_total" in names or time.monotonic() > deadline:
                return names
            time.sleep(0.5)
    finally:
        process.stop()


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((MONITORING / "kvfence-alerts.yaml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    doc = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for panel in doc["panels"] for t in panel["targets"]]
    exprs += [v["query"] for v in doc["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_every_metric_the_rules_and_dashboard_name_is_exported(exported: set[str]) -> None:
    assert {"kvfence_kv_fence_violations_total", "kvfence_kv_alerts_total",
            "kvfence_requests_total", "kvfence_ttft_seconds_bucket"} <= exported
    named = {m for e in dashboard_exprs() + [r["expr"] for r in rules()] for m in METRIC.findall(e)}
    assert named - exported == set()
    assert len(named) >= 15  # the dashboard covers the exported families, not a few


def test_the_check_would_see_a_misspelt_metric(exported: set[str]) -> None:
    assert "kvfence_kv_fence_violation_total" not in exported
    assert "kvfence_kv_alerts" not in exported  # a counter is scraped with its _total suffix


def test_the_rules_include_the_kv_anomaly_alerts_and_are_complete() -> None:
    by_name = {r["alert"]: r for r in rules()}
    assert "kvfence_kv_fence_violations_total" in by_name["KVFenceViolation"]["expr"]
    assert by_name["KVFenceViolation"]["labels"]["severity"] == "critical"
    assert 'kind="tenant"' in by_name["KVFenceTenantPagesOverThreshold"]["expr"]
    assert 'kind="request"' in by_name["KVFenceRequestPagesOverThreshold"]["expr"]
    for rule in rules():
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning", "info")
        assert rule["annotations"]["summary"]


def test_every_dashboard_panel_queries_the_datasource_variable() -> None:
    doc = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    assert [v["name"] for v in doc["templating"]["list"]] == ["datasource", "instance"]
    ids = [panel["id"] for panel in doc["panels"]]
    assert len(ids) == len(set(ids))
    for panel in doc["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        assert all('instance=~"$instance"' in t["expr"] for t in panel["targets"]), panel["title"]
