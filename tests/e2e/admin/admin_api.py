"""A client of the admin REST API (`/api/v1`) for the e2e tests: calls with the bearer token of a login."""

from __future__ import annotations

import aiohttp
from tbmq_launcher.launcher import Suite


class Api:
    def __init__(self, suite: Suite, http: aiohttp.ClientSession) -> None:
        self.suite = suite
        self.base = suite.admin_url().rstrip("/") + "/api/v1"
        self.http = http
        self.token: str | None = None

    async def call(self, method: str, path: str, *, json=None, auth: bool = True) -> tuple[int, dict]:
        headers = {"Authorization": f"Bearer {self.token}"} if auth and self.token else {}
        async with self.http.request(method, self.base + path, json=json, headers=headers) as r:
            return r.status, await r.json(content_type=None)

    async def get(self, path: str) -> dict:
        status, body = await self.call("GET", path)
        assert status == 200, (path, status, body)
        return body

    async def login_as_admin(self) -> "Api":
        """Log in as the suite's `admin` (the password the launcher generated); the token is used from then on."""
        status, body = await self.call("POST", "/auth/login", auth=False, json={
            "username": "admin", "password": self.suite.admin_password_file.read_text().strip()})
        assert status == 200 and body["token"], body
        self.token = body["token"]
        return self
