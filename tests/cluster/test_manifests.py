"""The deploy/ reference configurations: Kubernetes manifests validated offline against the
Kubernetes schemas (kubernetes-validate bundles them: no cluster, no download), and the
properties the scale-out design depends on, checked in the Envoy and HAProxy configs."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from service.admission.tenants import load_tenants

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
ENVOY = ROOT / "deploy" / "envoy" / "envoy.yaml"
HAPROXY = ROOT / "deploy" / "haproxy" / "haproxy.cfg"
# The oldest version with native gRPC probes (GA in 1.27) that the package bundles, and the
# newest it knows.
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())


def _resources() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc))
    return out


def _find(kind: str, name: str) -> dict[str, Any]:
    return next(d for _, d in _resources() if d["kind"] == kind and d["metadata"]["name"] == name)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_valid_against_the_kubernetes_schemas(version: str) -> None:
    resources = _resources()
    kinds = {d["kind"] for _, d in resources}
    assert {"Deployment", "Service", "PodDisruptionBudget", "Secret", "ConfigMap"} <= kinds
    for where, doc in resources:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{where}: {err.message} at {list(err.path)}")


def test_the_validator_refuses_a_misspelt_field() -> None:
    """Strict validation catches what kubectl would refuse (so the test above can fail)."""
    doc = _find("Deployment", "kvfence")
    broken = yaml.safe_load(yaml.safe_dump(doc))
    broken["spec"]["template"]["spec"]["terminationGracePeriod"] = 45
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSIONS[0], strict=True)
    broken = yaml.safe_load(yaml.safe_dump(doc))
    broken["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSIONS[0], strict=True)


def _flag(args: list[str], name: str) -> str:
    return next(a.split("=", 1)[1] for a in args if a.startswith(f"--{name}="))


def test_replica_deployment_drains_probes_grpc_and_reads_tenants_from_a_secret() -> None:
    pod = _find("Deployment", "kvfence")["spec"]["template"]
    container = pod["spec"]["containers"][0]
    args = container["args"]
    grace = float(_flag(args, "grace-seconds"))
    # The drain waits grace, then up to 5 s for aborted streams, then stops the server.
    assert pod["spec"]["terminationGracePeriodSeconds"] > grace + 6
    port = int(_flag(args, "port"))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": port}
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert _flag(args, "redis-url").startswith("redis://")
    assert _flag(args, "limits-on-redis-failure") in ("open", "closed")
    mount = container["volumeMounts"][0]
    assert _flag(args, "tenants") == f"{mount['mountPath']}/tenants.toml"
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
    secret = _find("Secret", volume["secret"]["secretName"])
    assert "tenants.toml" in secret["stringData"]
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == _flag(args, "metrics-port")
    pdb = _find("PodDisruptionBudget", "kvfence")
    assert pdb["spec"]["selector"]["matchLabels"] == pod["metadata"]["labels"]
    assert pdb["spec"]["maxUnavailable"] == 1


def test_the_example_tenants_secret_is_a_valid_tenants_file(tmp_path: Path) -> None:
    text = _find("Secret", "kvfence-tenants")["stringData"]["tenants.toml"]
    (tmp_path / "tenants.toml").write_text(text)
    registry = load_tenants(tmp_path / "tenants.toml")
    assert registry.names() == ("example",)


def test_envoy_configmap_is_deploy_envoy_yaml_verbatim() -> None:
    configmap = _find("ConfigMap", "kvfence-envoy")
    assert configmap["data"]["envoy.yaml"] == ENVOY.read_text()


def test_envoy_hashes_on_the_credential_checks_grpc_health_and_retries_only_unavailable() -> None:
    config = yaml.safe_load(ENVOY.read_text())
    cluster = config["static_resources"]["clusters"][0]
    assert cluster["lb_policy"] == "RING_HASH"
    assert cluster["health_checks"][0]["grpc_health_check"] == {}
    options = cluster["typed_extension_protocol_options"]
    assert "http2_protocol_options" in next(iter(options.values()))["explicit_http_config"]
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    route = manager["typed_config"]["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert route["hash_policy"] == [{"header": {"header_name": "authorization"}, "terminal": True}]
    assert route["retry_policy"]["retry_on"] == "unavailable"
    headless = _find("Service", "kvfence-replicas")
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert endpoint["address"]["socket_address"]["address"] == headless["metadata"]["name"]
    assert headless["spec"]["clusterIP"] == "None"


def _haproxy_lines() -> list[str]:
    return [line.split("#")[0].strip() for line in HAPROXY.read_text().splitlines()]


def test_haproxy_is_http2_end_to_end_with_consistent_credential_hashing() -> None:
    lines = _haproxy_lines()
    assert "balance hdr(authorization)" in lines
    assert "hash-type consistent" in lines
    assert any(line.startswith("hash-balance-factor ") for line in lines)
    assert any(line.startswith("bind ") and line.endswith("proto h2") for line in lines)
    assert any(line.startswith("default-server ") and "proto h2" in line for line in lines)
    assert "tcp-check expect binary 020801" in lines  # SERVING, not merely "answered"


HAPROXY_BIN = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin")


@pytest.mark.skipif(HAPROXY_BIN is None, reason="haproxy is not installed (make test installs it)")
def test_haproxy_accepts_the_reference_config() -> None:
    env = {
        **os.environ,
        "KVFENCE_LB_BIND": "127.0.0.1:1",
        **{f"KVFENCE_REPLICA_{i}": f"127.0.0.1:{i + 1}" for i in (1, 2, 3)},
    }
    done = subprocess.run(
        [str(HAPROXY_BIN), "-c", "-f", str(HAPROXY)], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stdout + done.stderr
