"""The `http` authentication provider's I/O (tbmq_auth.http holds what is asked and how the answer reads): one
aiohttp session per connector POSTing each CONNECT's question to MQTT_AUTH_HTTP_URL, at most MAX_CONNECTIONS
requests at a time (the others wait for a connection within their timeout), each bounded by
MQTT_AUTH_HTTP_TIMEOUT_S, an answer read up to MAX_ANSWER_BYTES. Whatever goes wrong on the way is an `error`
answer: the CONNECT is refused with 0x88 Server unavailable, never passed to the next provider.
"""

from __future__ import annotations

import asyncio
import ssl

import aiohttp
from tbmq_auth import HttpAnswer, parse_answer
from tbmq_auth.http import error

MAX_CONNECTIONS = 64
MAX_ANSWER_BYTES = 64 * 1024


class HttpAuthClient:
    def __init__(self, url: str, timeout_s: float, authorization: str = "", ca_file: str = "") -> None:
        self.url, self.timeout_s = url, timeout_s
        self.headers = {"Authorization": authorization} if authorization else {}
        self.ca_file = ca_file
        self._session: aiohttp.ClientSession | None = None  # made on the running loop, at the first question

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            ssl_ctx = ssl.create_default_context(cafile=self.ca_file or None)
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=MAX_CONNECTIONS, ssl=ssl_ctx),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s), headers=self.headers)
        return self._session

    async def ask(self, body: dict) -> HttpAnswer:
        try:
            async with self._open().post(self.url, json=body) as answer:
                data = await answer.content.read(MAX_ANSWER_BYTES + 1)
                if len(data) > MAX_ANSWER_BYTES:
                    return error(f"the authentication service's answer is larger than {MAX_ANSWER_BYTES} bytes")
                return parse_answer(answer.status, data)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return error(f"the authentication service did not answer ({type(exc).__name__}: {exc})")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


__all__ = ["MAX_ANSWER_BYTES", "MAX_CONNECTIONS", "HttpAuthClient"]
