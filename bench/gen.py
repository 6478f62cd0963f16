"""The load generator: worker processes (multiprocessing, spawn) driven over pipes."""

from __future__ import annotations

import multiprocessing as mp
import time

from .worker import worker_main


class WorkerError(RuntimeError):
    pass


class Generator:
    def __init__(self, n_workers: int, cpus: set[int] | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.cpus = sorted(cpus) if cpus else None
        self.workers = []
        for i in range(n_workers):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(child, i, self.cpus), name=f"bench-worker-{i}", daemon=True)
            p.start()
            child.close()
            self.workers.append((p, parent))

    def __len__(self) -> int:
        return len(self.workers)

    def pids(self) -> dict[str, int]:
        return {f"generator-{i}": p.pid for i, (p, _) in enumerate(self.workers)}

    def send(self, name: str, args: list[dict] | dict) -> None:
        per = args if isinstance(args, list) else [args] * len(self.workers)
        for (_, pipe), a in zip(self.workers, per):
            pipe.send((name, a))

    def recv(self, timeout: float, check: bool = True) -> list[dict]:
        out = []
        deadline = time.monotonic() + timeout
        for i, (p, pipe) in enumerate(self.workers):
            left = max(deadline - time.monotonic(), 0.01)
            if not pipe.poll(left):
                raise WorkerError(f"worker {i} did not answer within {timeout:.0f}s (alive={p.is_alive()})")
            r = pipe.recv()
            if check and not r.get("ok", False):
                raise WorkerError(f"worker {i}: {r.get('error') or r.get('errors')}\n{r.get('trace', '')}")
            out.append(r)
        return out

    def call(self, name: str, args: list[dict] | dict, timeout: float = 60.0, check: bool = True) -> list[dict]:
        self.send(name, args)
        return self.recv(timeout, check)

    def close(self) -> None:
        for p, pipe in self.workers:
            try:
                pipe.send(("stop", {}))
            except (OSError, BrokenPipeError):
                pass
        for p, pipe in self.workers:
            p.join(3)
            if p.is_alive():
                p.kill()
                p.join(1)
            pipe.close()
        self.workers = []
        # spawn starts multiprocessing's resource tracker; stop it too so no helper process outlives us
        # (it is started again on demand by the next Generator)
        try:
            from multiprocessing import resource_tracker
            resource_tracker._resource_tracker._stop()
        except Exception:
            pass
