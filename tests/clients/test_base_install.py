from __future__ import annotations

import subprocess
import sys

from tests.clients.conftest import repo_root


def test_clients_load_without_the_server_stack() -> None:
    """clients/ is the base install: importing it (and its CLI) pulls in no server module."""
    code = (
        "import sys, clients, clients.cli, clients.aio\n"
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    loaded = set(
        subprocess.check_output([sys.executable, "-c", code], cwd=repo_root(), text=True).split()
    )
    assert {"clients", "grpc", "tenacity", "structlog", "google", "protos"} <= loaded
    assert not loaded & {"torch", "numpy", "service", "kvcache", "transformers", "tokenizers"}
