"""The Dockerfile, checked without a container runtime (none here): it installs what the
Makefile installs (the torch pin first, then the package with extras that exist), runs as
the user the manifests expect, starts `kvfence serve`, and its health check answers from
grpc.health.v1; the Kubernetes manifest and the Helm chart name the image `make image-cuda`
builds."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
MAKEFILE = (ROOT / "Makefile").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE)
    lines = [line.strip() for line in text.splitlines()]
    return [(line.split(None, 1)[0], line.split(None, 1)[1]) for line in lines
            if line and not line.startswith("#")]


def arg_default(name: str) -> str:
    return next(a.split("=", 1)[1] for op, a in instructions()
                if op == "ARG" and a.split("=", 1)[0] == name)


def make_var(name: str) -> str:
    match = re.search(rf"^{name} \?= (.*)$", MAKEFILE, re.M)
    assert match is not None, name
    return match.group(1)


def make_recipe(target: str) -> str:
    match = re.search(rf"^{target}:.*\n((?:\t.*\n)+)", MAKEFILE, re.M)
    assert match is not None, target
    return match.group(1).replace("\\\n", " ")


def runs() -> list[str]:
    return [a for op, a in instructions() if op == "RUN"]


def test_torch_is_installed_first_with_the_makefiles_pin_and_a_cpu_index() -> None:
    assert arg_default("TORCH_SPEC") == make_var("TORCH_SPEC") == "torch==2.13.0"
    assert arg_default("TORCH_INDEX") == "https://download.pytorch.org/whl/cpu"
    pip = [r for r in runs() if r.startswith("pip install")]
    # As the Makefile's $(if $(TORCH_INDEX),--index-url ...): no index flag when it is empty.
    assert pip[0] == 'pip install --no-cache-dir "${TORCH_SPEC}" ${TORCH_INDEX:+--index-url "${TORCH_INDEX}"}'
    assert pip[1] == 'pip install --no-cache-dir ".[${EXTRAS}]"'
    install = make_recipe(r"\$\(STAMP\)")
    assert install.index('"$(TORCH_SPEC)"') < install.index('-e ".[server,dev]"')


def test_the_extras_exist_and_the_cuda_build_adds_gpu_on_pypis_torch() -> None:
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    cpu = arg_default("EXTRAS").split(",")
    assert "server" in cpu and set(cpu) <= extras and "gpu" not in cpu
    cuda = shlex.split(make_recipe("image-cuda"))
    build_args = dict(cuda[i + 1].split("=", 1) for i, a in enumerate(cuda) if a == "--build-arg")
    assert build_args["TORCH_INDEX"] == ""  # PyPI's torch: a CUDA build on Linux x86_64
    assert build_args["TORCH_SPEC"] == "$(TORCH_SPEC)"
    assert set(build_args["EXTRAS"].split(",")) == {*cpu, "gpu"} and "gpu" in extras
    assert cuda[cuda.index("-t") + 1] == "$(IMAGE_CUDA)"


def test_the_image_holds_every_package_and_starts_kvfence_serve_as_non_root() -> None:
    copied = {src for op, a in instructions() if op == "COPY" for src in a.split()[:-1]}
    packages = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {p.rstrip("*") for p in packages} <= copied
    assert {"pyproject.toml", "README.md"} <= copied
    users = [a for op, a in instructions() if op == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert json.loads(next(a for op, a in instructions() if op == "ENTRYPOINT")) == [
        "kvfence", "serve"]
    assert instructions()[0] == ("FROM", "python:3.11-slim")


def deployment() -> dict[str, Any]:
    docs = yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "kvfence.yaml").read_text())
    return next(d for d in docs if d["kind"] == "Deployment")


def test_the_manifest_and_chart_run_the_image_make_builds() -> None:
    version = PYPROJECT["project"]["version"]
    assert make_var("IMAGE") == f"kvfence:{version}"
    assert make_var("IMAGE_CUDA") == "$(IMAGE)-cuda"
    pod = deployment()["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == f"kvfence:{version}-cuda"  # --device=cuda: the CUDA variant
    assert "--device=cuda" in container["args"]
    assert container["args"][0] != "serve"  # the entrypoint is already `kvfence serve`
    uid = re.search(r"useradd .*--uid (\d+)", DOCKERFILE)
    assert uid is not None
    assert container["securityContext"]["runAsUser"] == int(uid.group(1))
    exposed = {int(p) for op, a in instructions() if op == "EXPOSE" for p in a.split()}
    assert {p["containerPort"] for p in container["ports"]} <= exposed
    values = yaml.safe_load((ROOT / "deploy" / "helm" / "kvfence" / "values.yaml").read_text())
    assert f"{values['image']['repository']}:{values['image']['tag']}" == container["image"]
    chart = yaml.safe_load((ROOT / "deploy" / "helm" / "kvfence" / "Chart.yaml").read_text())
    assert chart["appVersion"] == version


def healthcheck_command() -> list[str]:
    check = next(a for op, a in instructions() if op == "HEALTHCHECK")
    return shlex.split(check.split(" CMD ", 1)[1])


def run_healthcheck(status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> int:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", status)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        command = healthcheck_command()
        assert command[0] == "python"
        done = subprocess.run([sys.executable, *command[1:]], capture_output=True, timeout=30,
                              env={"KVFENCE_PORT": str(port), "PATH": "/usr/bin:/bin"})
        return done.returncode
    finally:
        server.stop(None)


def test_the_healthcheck_passes_only_while_grpc_health_says_serving() -> None:
    assert run_healthcheck(health_pb2.HealthCheckResponse.SERVING) == 0
    assert run_healthcheck(health_pb2.HealthCheckResponse.NOT_SERVING) != 0
