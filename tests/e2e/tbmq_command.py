"""The `tbmq` command line (tbmq_platform.cli, installed beside the interpreter) run against a suite's Kafka, for
the end-to-end tests of every folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TBMQ = str(Path(sys.executable).with_name("tbmq"))


def tbmq(s, *args: str, stdin: str | None = None) -> str:
    """The `tbmq` command line against the suite's Kafka; its stdout (asserted to succeed)."""
    done = subprocess.run([TBMQ, *args, "--bootstrap-servers", s.bootstrap_servers], input=stdin,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout
