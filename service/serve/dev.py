"""``make serve``: a development server on the default model with a ready-made tenant.

Creates the tenants file with a ``dev`` tenant (and writes its key to ``dev-key.txt`` next
to it) when the file is absent, prints a command to paste, then runs ``kvfence serve``
with the remaining arguments.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from service.admission.tenants import TenantsFileError, add_tenant
from service.serve import commands as cli

DEV_TENANT = "dev"
KEY_FILE = "dev-key.txt"
# A chat-templated, greedy request with room for a whole sentence: the instruct model answers
# the same sensible line every time, where a raw 16-token sample stops mid-word.
TRY_PROMPT = "Describe a garden fence in one short sentence."
TRY_FLAGS = ("--temperature", "0", "--max-tokens", "64")


def ensure_dev_tenant(tenants: Path) -> str:
    """The dev tenant's key, creating the tenants file and the key file if needed."""
    key_file = tenants.parent / KEY_FILE
    if not tenants.exists():
        key = add_tenant(tenants, DEV_TENANT)
        key_file.write_text(key + "\n", encoding="utf-8")
        key_file.chmod(0o600)
        return key
    if not key_file.exists():
        raise TenantsFileError(
            f"{tenants} exists but {key_file} does not; delete both to get a fresh dev tenant"
        )
    return key_file.read_text(encoding="utf-8").strip()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvfence-dev", add_help=False)
    parser.add_argument("--tenants", default="dev/tenants.toml")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", default="50051")
    known, rest = parser.parse_known_args(argv)
    tenants = Path(known.tenants)
    try:
        key = ensure_dev_tenant(tenants)
    except (OSError, TenantsFileError) as err:
        print(f"make serve: error: {err}", file=sys.stderr)
        return 2
    kvfence = Path(sys.executable).with_name("kvfence")
    target = f"{known.host}:{known.port}"
    print(f"dev tenant key is in {tenants.parent / KEY_FILE}. Once it is serving, try:",
          flush=True)
    print(f'  {kvfence} generate --chat "{TRY_PROMPT}" {" ".join(TRY_FLAGS)} '
          f"--target {target} --api-key {key}", flush=True)
    return cli.main(
        ["serve", "--tenants", str(tenants), "--host", known.host, "--port", str(known.port), *rest]
    )


if __name__ == "__main__":
    sys.exit(main())
