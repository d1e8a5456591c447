#!/usr/bin/env bash
# Regenerates the committed Python stubs from protos/kvfence/v1/*.proto.
# Usage: protos/generate.sh [OUT_DIR]   (default: protos/, i.e. in place)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-protos}"
py="${PYTHON:-.venv/bin/python}"
mkdir -p "$out/kvfence/v1"
"$py" -m grpc_tools.protoc -I protos \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  --mypy_grpc_out="$out" \
  --plugin=protoc-gen-mypy_grpc="$(dirname "$py")/protoc-gen-mypy_grpc" \
  protos/kvfence/v1/inference.proto protos/kvfence/v1/cache.proto \
  protos/kvfence/v1/adapters.proto
# The stubs live in the `protos` package: make their cross imports absolute to it.
for f in "$out"/kvfence/v1/*_pb2*.py "$out"/kvfence/v1/*_pb2*.pyi; do
  sed -i -e 's/^from kvfence\.v1 import/from protos.kvfence.v1 import/' \
         -e 's/^import kvfence\.v1\./import protos.kvfence.v1./' "$f"
done
