"""deploy/helm/kvfence: with its default values the chart renders the reference manifests in
deploy/kubernetes/ object for object, valid against the Kubernetes schemas; its values change
what they say. `helm` is not installed here, so tests/cluster/helm_render.py renders the
chart (the subset of Helm's templates it uses); where `helm` is on PATH the chart is also
rendered by `helm template` and compared."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.cluster.helm_render import UnsupportedTemplate, render
from tests.cluster.test_manifests import K8S, VERSIONS

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "kvfence"
HELM = shutil.which("helm")


def default_values() -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    return values


def rendered(values: dict[str, Any], release: str = "kvfence") -> list[dict[str, Any]]:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    meta = {"Name": chart["name"], "Version": chart["version"], "AppVersion": chart["appVersion"]}
    docs = []
    for template in sorted((CHART / "templates").glob("*.yaml")):
        text = render(template.read_text(), values, release, meta)
        docs += [d for d in yaml.safe_load_all(text) if d is not None]
    return docs


def by_key(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def reference() -> dict[tuple[str, str], dict[str, Any]]:
    names = ("kvfence.yaml", "service.yaml", "tenants-secret.yaml", "pdb.yaml")
    return by_key([d for n in names for d in yaml.safe_load_all((K8S / n).read_text()) if d])


def test_default_values_render_the_reference_manifests() -> None:
    chart = by_key(rendered(default_values()))
    assert set(chart) == {("Deployment", "kvfence"), ("Service", "kvfence-replicas"),
                          ("Secret", "kvfence-tenants"), ("PodDisruptionBudget", "kvfence")}
    ref = reference()
    deployment = chart[("Deployment", "kvfence")]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container.pop("imagePullPolicy") == "IfNotPresent"  # the one field the chart adds
    assert chart == ref


@pytest.mark.parametrize("version", VERSIONS)
def test_rendered_manifests_are_valid_against_the_kubernetes_schemas(version: str) -> None:
    for doc in rendered(default_values()) + rendered(changed_values()):
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {err.message} at {list(err.path)}")


def changed_values() -> dict[str, Any]:
    values = copy.deepcopy(default_values())
    values["image"]["tag"] = "0.2.0"
    values["redisUrl"] = ""
    values["extraArgs"] = ["--model=org/name", "--http-port=8000"]
    values["tenants"]["existingSecret"] = "my-tenants"
    values["replicas"] = 1
    return values


def test_values_change_what_they_name() -> None:
    chart = by_key(rendered(changed_values(), release="edge"))
    assert set(chart) == {("Deployment", "edge"), ("Service", "edge-replicas"),
                          ("PodDisruptionBudget", "edge")}  # no Secret: an existing one
    pod = chart[("Deployment", "edge")]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == "kvfence:0.2.0"
    assert not any(a.startswith(("--redis-url", "--limits-on", "--stream-lease")) for a in
                   container["args"])
    assert container["args"][-3:] == ["--log-format=json", "--model=org/name", "--http-port=8000"]
    assert pod["volumes"][0]["secret"]["secretName"] == "my-tenants"
    assert chart[("Deployment", "edge")]["spec"]["replicas"] == 1


def test_the_renderer_refuses_what_it_does_not_understand() -> None:
    with pytest.raises(UnsupportedTemplate):
        render("{{ .Values.a | default 3 }}", {"a": 1}, "r", {})
    with pytest.raises(UnsupportedTemplate):
        render("{{ range .Values.a }}x{{ end }}", {"a": [1]}, "r", {})
    assert render("a:\n  {{- if .Values.x }} yes{{ else }} no{{ end }}", {"x": ""}, "r", {}) == (
        "a: no")


@pytest.mark.skipif(HELM is None, reason="helm is not installed (the chart is rendered by "
                    "tests/cluster/helm_render.py above)")
def test_helm_template_renders_the_same() -> None:
    assert HELM is not None
    out = subprocess.run([HELM, "template", "kvfence", str(CHART)], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert by_key([d for d in yaml.safe_load_all(out) if d]) == by_key(rendered(default_values()))
