"""The Spark statistics job (`python -m tbmq_spark stats`, docs/spark.md) as a supervised process of the suite.

It has no health endpoint: it is ready when it has written its ready file (`--ready-file`, JSON, written once
the streaming query is active; the log shows "stats query started" at the same moment).

Process tree: the job's Python process (leader of its own process group) → spark-submit's JVM (same group)
→ pyspark's worker daemon (its own group: daemon.py calls setpgid) → Python workers. Stopping: SIGTERM to the
Python process only (it stops the query and the SparkContext, and the JVM ends with it), SIGKILL to the group
after a timeout, and then SIGKILL to whatever the tree held before the stop and is still there (the worker
daemon's group), identified by pid *and* start time, so a reused pid is never hit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

from .process import kill_group
from .services import ServiceDef, ServiceProcess, ServiceStartError

NAME = "spark-stats"


def stats_argv(bootstrap: str, output: Path, ready_file: Path, extra: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "tbmq_spark", "stats", "--bootstrap", bootstrap, "--output", str(output),
            "--ready-file", str(ready_file), *extra]


def _proc_start_time(pid: int) -> int | None:
    """Start time (clock ticks since boot, /proc/<pid>/stat field 22) or None when gone / not Linux."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ')'
    fields = data[data.rfind(b")") + 2:].split()
    try:
        if fields[0] == b"Z":          # a zombie is gone for our purposes
            return None
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def descendants(pid: int) -> list[tuple[int, int]]:
    """(pid, start time) of every process below `pid` (Linux /proc; [] elsewhere)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for e in entries:
        if not e.isdigit():
            continue
        try:
            data = Path(f"/proc/{e}/stat").read_bytes()
            ppid = int(data[data.rfind(b")") + 2:].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(e))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        st = _proc_start_time(p)
        if st is not None:
            out.append((p, st))
        todo.extend(children.get(p, []))
    return out


def alive(procs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return [(p, st) for p, st in procs if _proc_start_time(p) == st]


class SparkJobProcess(ServiceProcess):
    """The stats job: a ServiceProcess whose readiness is its ready file, stopped gracefully by SIGTERM to
    its Python process and never leaving a JVM or a Python worker behind."""

    def __init__(self, bootstrap: str, run_dir: Path, extra_args: tuple[str, ...] = (), *, echo=None,
                 color: str | None = None, env: dict[str, str] | None = None) -> None:
        self.output = run_dir / "spark"
        self.ready_file = run_dir / "logs" / f"{NAME}.ready"
        self.extra_args = tuple(extra_args)
        sdef = ServiceDef(NAME, "tbmq_spark", health_port=0,
                          command=tuple(stats_argv(bootstrap, self.output, self.ready_file, self.extra_args)))
        super().__init__(sdef, 1, NAME, env or {}, 0, run_dir / "logs" / f"{NAME}.log", echo=echo,
                         color=color, cwd=run_dir)
        self.ready_info: dict | None = None

    async def start(self, timeout: float = 180.0) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.ready_file.unlink()
        self.ready_info = None
        await super().start(timeout)

    async def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None
            if self.proc.returncode is not None:
                await self._drain()
                raise ServiceStartError(
                    f"{self.service_id} exited with code {self.proc.returncode} before its query started; "
                    f"log {self.log_path}:\n{self.log_tail()}")
            try:
                info = json.loads(self.ready_file.read_text())
                if info.get("pid") == self.proc.pid:
                    self.ready_info = info
                    return
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise ServiceStartError(
                    f"{self.service_id}: streaming query not started within {timeout:.0f}s (no {self.ready_file}); "
                    f"log {self.log_path}:\n{self.log_tail()}")
            await asyncio.sleep(0.2)

    async def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        proc = self.proc
        if proc is None:
            return self.returncode
        tree = descendants(proc.pid)
        try:
            if proc.returncode is None:
                if sig == signal.SIGTERM:
                    # the Python process alone: it stops the query and the session; a SIGTERM to the whole
                    # group would make the JVM shut down under it
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(proc.pid, sig)
                else:
                    kill_group(proc.pid, sig)
                try:
                    await asyncio.wait_for(proc.wait(), timeout)
                except asyncio.TimeoutError:
                    kill_group(proc.pid, signal.SIGKILL)
                    await proc.wait()
            # the JVM and anything else left in the job's group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            # pyspark's worker daemon runs in a group of its own; it exits on its own once the JVM is gone
            # (EOF on its stdin): a short bounded wait, then SIGKILL
            deadline = time.monotonic() + 5
            left = alive(tree)
            while left and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                left = alive(tree)
            for pid, _ in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            await self._drain()
        finally:
            if self._pump is not None and not self._pump.done():
                self._pump.cancel()
            self._pump = None
            self.returncode = proc.returncode
            self.proc = None
        with contextlib.suppress(FileNotFoundError):
            self.ready_file.unlink()
        return self.returncode
