"""Small process helpers shared by the Kafka broker and the service launcher."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from collections.abc import Callable
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def death_signal_preexec(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A preexec_fn asking Linux to send `sig` to the child when its parent dies (no orphan JVM when the
    launcher or pytest is SIGKILLed). None elsewhere."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)

    return preexec


def kill_group(pid: int, sig: int) -> bool:
    """Send `sig` to the process group led by `pid` (children started with start_new_session=True);
    falls back to the pid alone. False when nothing was there."""
    try:
        os.killpg(pid, sig)
        return True
    except ProcessLookupError:
        pass
    except PermissionError:
        pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)
        return True
    return False


def tail(path: str | os.PathLike, lines: int = 40, max_bytes: int = 64 * 1024) -> str:
    """The last `lines` lines of a text file ('' when missing)."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", errors="replace").splitlines()[-lines:])
