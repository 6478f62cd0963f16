#!/usr/bin/env bash
# The one way to (re)generate the Python code of proto/. Output is committed; tests/unit/test_proto_drift.py
# runs this into a temporary folder and fails when the committed code differs.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-"$root/libs/tbmq-proto/src"}
py=${PYTHON:-"$root/.venv/bin/python"}
case "$py" in /*) ;; *) py="$root/$py" ;; esac
[ -x "$py" ] || py=python3
mkdir -p "$out/tbmq/v1"
cd "$root/proto"
"$py" -m grpc_tools.protoc -I . \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  tbmq/v1/messages.proto tbmq/v1/services.proto
touch "$out/tbmq/__init__.py" "$out/tbmq/v1/__init__.py"
