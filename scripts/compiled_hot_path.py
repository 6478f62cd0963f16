"""The message path's own Python compiled with Cython, in place, for an A/B of `make bench` against the same code
interpreted (docs/performance.md, "The fortieth round"). A measurement tool: nothing in the suite builds or
needs these extensions, and a tree left built runs the compiled modules (Python imports an extension module
before the .py beside it), so edits to those .py files do nothing until `clean`.

    .venv/bin/python scripts/compiled_hot_path.py build   # cythonize -i -3 the modules below (a few minutes)
    .venv/bin/python scripts/compiled_hot_path.py status  # which of them import compiled now
    .venv/bin/python scripts/compiled_hot_path.py clean   # back to the interpreted code

`build` uses Cython from a scratch virtual environment (/tmp/tbmq-cython, made and filled from PyPI on first
use; the suite's .venv is not touched) and the interpreter that runs this script, so the extensions match the
services' CPython. The modules are every one the p2p path's CPU profiles name (scripts/cpu_profile.py): the
connector's codec, machine and connection, the router's routing, store and forwards.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CYTHON = "Cython==3.3.1"
SCRATCH = Path("/tmp/tbmq-cython")
MODULES = (
    "libs/tbmq-mqtt/src/tbmq_mqtt/codec.py",
    "libs/tbmq-mqtt/src/tbmq_mqtt/_wire.py",
    "libs/tbmq-mqtt/src/tbmq_mqtt/properties.py",
    "libs/tbmq-mqtt/src/tbmq_mqtt/packets.py",
    "libs/tbmq-connection/src/tbmq_connection/machine.py",
    "libs/tbmq-connection/src/tbmq_connection/flow.py",
    "libs/tbmq-connection/src/tbmq_connection/convert.py",
    "libs/tbmq-connection/src/tbmq_connection/effects.py",
    "libs/tbmq-connection/src/tbmq_connection/limits.py",
    "services/connector/src/connector/connection.py",
    "services/connector/src/connector/service.py",
    "services/connector/src/connector/grpc_clients.py",
    "libs/tbmq-routing/src/tbmq_routing/rules.py",
    "libs/tbmq-routing/src/tbmq_routing/trie.py",
    "services/router/src/router/app.py",
    "services/router/src/router/convert.py",
    "services/router/src/router/state.py",
    "services/router/src/router/persist.py",
    "libs/tbmq-device-persistence/src/tbmq_device_persistence/store.py",
    "libs/tbmq-device-persistence/src/tbmq_device_persistence/service.py",
    "libs/tbmq-device-persistence/src/tbmq_device_persistence/forward.py",
    "libs/tbmq-device-persistence/src/tbmq_device_persistence/grpc_api.py",
)


def _module_name(path: str) -> str:
    return path.split("/src/", 1)[1].removesuffix(".py").replace("/", ".")


def build() -> None:
    cythonize = SCRATCH / "bin" / "cythonize"
    if not cythonize.exists():
        subprocess.run([sys.executable, "-m", "venv", str(SCRATCH)], check=True)
        subprocess.run([str(SCRATCH / "bin" / "pip"), "install", "-q", CYTHON, "setuptools"], check=True)
    # the scratch environment's interpreter is this one (same CPython, same ABI as the services')
    subprocess.run([str(cythonize), "-i", "-3", "-j", str(os.cpu_count() or 1), *MODULES], cwd=ROOT, check=True)
    status()


def clean() -> None:
    for rel in MODULES:
        src = ROOT / rel
        for made in [src.with_suffix(".c"), *src.parent.glob(src.stem + ".cpython-*.so")]:
            made.unlink(missing_ok=True)
    for build_dir in {(ROOT / rel).parents[1] / "build" for rel in MODULES}:
        shutil.rmtree(build_dir, ignore_errors=True)
    status()


def status() -> None:
    compiled = 0
    for rel in MODULES:
        name = _module_name(rel)
        where = Path(importlib.import_module(name).__file__ or "")
        compiled += where.suffix == ".so"
        print(f"{'compiled' if where.suffix == '.so' else 'python  '}  {name}")
    print(f"{compiled} of {len(MODULES)} compiled")


if __name__ == "__main__":
    commands = {"build": build, "clean": clean, "status": status}
    if len(sys.argv) != 2 or sys.argv[1] not in commands:
        sys.exit(f"usage: {sys.argv[0]} {'|'.join(commands)}")
    commands[sys.argv[1]]()
