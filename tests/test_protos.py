"""The committed Python stubs must be exactly what `make protos` generates now."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENERATED = sorted((ROOT / "protos" / "kvfence" / "v1").glob("*_pb2*.py*"))


def test_stubs_exist() -> None:
    names = {p.name for p in GENERATED}
    for stem in ("inference", "cache"):
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi"):
            assert stem + suffix in names


def test_stubs_are_not_stale(tmp_path: Path) -> None:
    env_py = str(Path(sys.executable))
    subprocess.run(
        ["bash", str(ROOT / "protos" / "generate.sh"), str(tmp_path)],
        check=True,
        cwd=ROOT,
        env={"PYTHON": env_py, "PATH": "/usr/bin:/bin"},
    )
    fresh = sorted((tmp_path / "kvfence" / "v1").glob("*_pb2*.py*"))
    assert [p.name for p in fresh] == [p.name for p in GENERATED]
    stale = [
        p.name
        for p in GENERATED
        if not filecmp.cmp(p, tmp_path / "kvfence" / "v1" / p.name, shallow=False)
    ]
    assert stale == [], f"stale generated stubs (run `make protos`): {stale}"


def test_no_request_message_can_name_a_tenant() -> None:
    from protos.kvfence.v1 import cache_pb2, inference_pb2

    for module in (inference_pb2, cache_pb2):
        for message in module.DESCRIPTOR.message_types_by_name.values():
            for field in message.fields:
                assert "tenant" not in field.name.lower(), (message.name, field.name)
