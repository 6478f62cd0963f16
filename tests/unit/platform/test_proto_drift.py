"""The committed generated code must be exactly what scripts/gen-proto.sh produces from proto/."""

import filecmp
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_generated_code_matches_proto(tmp_path):
    subprocess.run(["bash", str(ROOT / "scripts/gen-proto.sh"), str(tmp_path)], check=True,
                   env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    committed = ROOT / "libs/tbmq-proto/src/tbmq/v1"
    fresh = tmp_path / "tbmq/v1"
    names = sorted(p.name for p in fresh.iterdir() if p.is_file())
    assert names, "code generation produced nothing"
    assert sorted(p.name for p in committed.iterdir() if p.is_file() and p.suffix != ".pyc") == names
    stale = [n for n in names if not filecmp.cmp(committed / n, fresh / n, shallow=False)]
    assert not stale, f"generated code is stale, run `make proto`: {stale}"


def test_every_proto_file_is_generated():
    protos = sorted(p.stem for p in (ROOT / "proto/tbmq/v1").glob("*.proto"))
    generated = sorted(p.name[: -len("_pb2.py")] for p in (ROOT / "libs/tbmq-proto/src/tbmq/v1").glob("*_pb2.py"))
    assert protos == generated
