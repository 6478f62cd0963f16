"""Headless Chromium driven over the Chrome DevTools Protocol (a websocket), for the admin web UI's tests.

No browser driver package: Debian's `chromium` (scripts/bootstrap.sh installs it) started with
--remote-debugging-port=0, its DevTools address read from its output, one page target, and three calls:
`goto`, `evaluate` (JavaScript in the page, awaited), `screenshot` (PNG). Waiting goes through tests/waits.py.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
from pathlib import Path

import aiohttp
from waits import wait_until


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    def __init__(self, profile: Path) -> None:
        self.profile = profile
        self.proc: asyncio.subprocess.Process | None = None
        self.http: aiohttp.ClientSession | None = None
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None
        self.console: list[str] = []

    async def start(self) -> "Browser":
        self.proc = await asyncio.create_subprocess_exec(
            chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--no-first-run", "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
            f"--user-data-dir={self.profile}", "--window-size=1280,900", "about:blank",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, start_new_session=True)
        address = None
        async with asyncio.timeout(60):
            while address is None:
                line = (await self.proc.stderr.readline()).decode(errors="replace")
                if not line:
                    raise RuntimeError("chromium exited before its DevTools endpoint was up")
                m = re.search(r"DevTools listening on ws://([^/]+)/", line)
                address = m.group(1) if m else None
        self._drain = asyncio.create_task(self._drain_stderr())
        self.http = aiohttp.ClientSession()
        async with self.http.get(f"http://{address}/json/list") as r:
            pages = [t for t in await r.json() if t["type"] == "page"]
        self.ws = await self.http.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)
        self._reader = asyncio.create_task(self._read())
        await self.call("Page.enable")
        await self.call("Runtime.enable")
        return self

    async def _drain_stderr(self) -> None:
        while await self.proc.stderr.readline():
            pass

    async def _read(self) -> None:
        async for msg in self.ws:
            data = json.loads(msg.data)
            if "id" in data and data["id"] in self._waiting:
                self._waiting.pop(data["id"]).set_result(data)
            elif data.get("method") == "Runtime.consoleAPICalled":
                self.console.append(" ".join(str(a.get("value", a.get("description", "")))
                                             for a in data["params"]["args"]))

    async def call(self, method: str, **params) -> dict:
        i = next(self._ids)
        fut = self._waiting[i] = asyncio.get_running_loop().create_future()
        await self.ws.send_str(json.dumps({"id": i, "method": method, "params": params}))
        async with asyncio.timeout(30):
            answer = await fut
        if "error" in answer:
            raise RuntimeError(f"{method}: {answer['error']}")
        return answer["result"]

    async def evaluate(self, expression: str):
        r = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression!r}: {r['exceptionDetails']}")
        return r["result"].get("value")

    async def goto(self, url: str) -> None:
        await self.call("Page.navigate", url=url)
        await wait_until(lambda: self._ready(url), 30, f"page {url} loaded")

    async def _ready(self, url: str) -> bool:
        try:
            return await self.evaluate(f"document.readyState === 'complete' && location.href.startsWith({url!r})")
        except RuntimeError:  # the context is being replaced during navigation
            return False

    async def text(self, selector: str) -> str:
        return await self.evaluate(f"(document.querySelector({selector!r}) || {{}}).innerText || ''")

    async def screenshot(self, path: Path) -> Path:
        r = await self.call("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(r["data"]))
        return path

    async def stop(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self.ws is not None:
            await self.ws.close()
        if self.http is not None:
            await self.http.close()
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                async with asyncio.timeout(10):
                    await self.proc.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                await self.proc.wait()
