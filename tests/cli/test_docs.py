"""What a newcomer copies from README.md, examples/ and the Makefile works as written."""

from __future__ import annotations

import re
import subprocess

from google.protobuf import json_format

from protos.kvfence.v1 import inference_pb2
from tests.cli.conftest import ROOT

README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_grpcurl_example_is_a_valid_generate_request() -> None:
    [body] = re.findall(r"grpcurl .*?-d '(\{.*?\})'", README, re.DOTALL)
    request = json_format.Parse(body, inference_pb2.GenerateRequest())
    assert (request.text, request.stopping.max_tokens) == ("Once upon a time", 32)
    assert "kvfence.v1.Inference/Generate" in README


def test_readme_states_the_real_log_default_and_sampling_defaults() -> None:
    assert "JSON by default" not in README
    assert "`--log-format auto` (the default)" in README
    assert "| `--max-tokens` | 16 (`kvfence chat`: 256) |" in README
    assert "| `--temperature` | 1.0 | 0 = greedy |" in README


def test_readme_names_the_san_types_that_map_to_a_tenant() -> None:
    from service.admission.tenants import SAN_TYPES

    # The README names every SAN type the tenants file accepts, in the form the file uses.
    for kind in SAN_TYPES:
        assert f"`{kind}:" in README, kind
    assert "matched by type" in README


def test_examples_show_kvfence_keys() -> None:
    keys = [m for p in sorted((ROOT / "examples").glob("*.py"))
            for m in re.findall(r"KVFENCE_API_KEY=(\S+)", p.read_text(encoding="utf-8"))]
    assert keys and all(k == "kvf_..." for k in keys)


def test_make_serve_passes_args_to_serve() -> None:
    run = subprocess.run(["make", "-n", "serve", 'ARGS=--metrics-port 9464'], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    [line] = [line for line in run.stdout.splitlines() if "service.serve.dev" in line]
    assert line.endswith("--metrics-port 9464")
    assert 'make serve ARGS="--metrics-port 9464' in README
