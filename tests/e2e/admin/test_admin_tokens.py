"""Two admin instances behind one address (ADMIN_TOKEN_SECRET shared, docs/operations.md): a token issued by one
is taken by the other, also after the issuing instance restarted, and a logout on either refuses the token on
both (tbmq.admin.tokens.revoked), also on an instance started after the logout; a user removed from the
users file, or given a new password, loses its tokens on both without a restart."""

from __future__ import annotations

import functools

import aiohttp
import pytest
from admin_users import write_users
from argon2 import PasswordHasher
from mqtt_clients import wait_until
from suites import module_suite

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

BOUND = 30.0
SECRET = "an-admin-token-secret-of-32-bytes-at-least"


@pytest.fixture(scope="module")
async def admins(kafka, tmp_path_factory):
    async with module_suite(kafka, tmp_path_factory, "suite-admin-tokens", services=["admin"],
                            instances={"admin": 2}, env={"ADMIN_TOKEN_SECRET": SECRET}) as s:
        yield s


async def call(http: aiohttp.ClientSession, suite, instance: int, method: str, path: str, token: str | None = None,
               json=None) -> tuple[int, dict]:
    url = suite.admin_url(instance).rstrip("/") + "/api/v1" + path
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with http.request(method, url, json=json, headers=headers) as r:
        return r.status, await r.json(content_type=None)


async def login(http, suite, instance: int) -> str:
    status, body = await call(http, suite, instance, "POST", "/auth/login", json={
        "username": "admin", "password": suite.admin_password_file.read_text().strip()})
    assert status == 200, body
    return body["token"]


async def test_a_token_works_on_both_instances_and_a_logout_on_one_ends_it_on_both(admins):
    async with aiohttp.ClientSession() as http:
        token = await login(http, admins, 1)
        assert (await call(http, admins, 2, "GET", "/sessions", token))[0] == 200
        other = await login(http, admins, 2)
        assert (await call(http, admins, 2, "POST", "/auth/logout", token))[0] == 200  # logged out on 2
        assert (await call(http, admins, 2, "GET", "/sessions", token))[0] == 401

        async def refused_on_1() -> bool:
            return (await call(http, admins, 1, "GET", "/sessions", token))[0] == 401

        await wait_until(refused_on_1, BOUND, "the logout on instance 2 reaching instance 1")
        for instance in (1, 2):  # the other login is untouched
            assert (await call(http, admins, instance, "GET", "/sessions", other))[0] == 200


async def test_tokens_survive_a_restart_and_a_logout_is_read_back_at_start_up(admins):
    async with aiohttp.ClientSession() as http:
        token = await login(http, admins, 1)
        await admins.restart_service("admin", 1)
        assert (await call(http, admins, 1, "GET", "/sessions", token))[0] == 200
        assert (await call(http, admins, 1, "POST", "/auth/logout", token))[0] == 200
        await admins.restart_service("admin", 2)  # reads the revocation back from the topic at start-up
        assert (await call(http, admins, 2, "GET", "/sessions", token))[0] == 401


async def test_a_user_removed_or_given_a_new_password_loses_its_tokens_on_every_instance(admins):
    """ADMIN_USERS_FILE is read again when it changes: a user added logs in, and changing its password or removing
    it ends the token it had, on both instances, without a restart."""
    users = admins.admin_users_file
    original = users.read_text()

    write = functools.partial(write_users, users)
    async with aiohttp.ClientSession() as http:
        try:
            write(original + f"ops:{PasswordHasher().hash('first-password')}\n")
            status, body = await call(http, admins, 1, "POST", "/auth/login",
                                      json={"username": "ops", "password": "first-password"})
            assert status == 200, body
            token = body["token"]
            assert all([(await call(http, admins, i, "GET", "/sessions", token))[0] == 200 for i in (1, 2)])
            write(original + f"ops:{PasswordHasher().hash('second-password')}\n")  # a new password
            for i in (1, 2):
                assert (await call(http, admins, i, "GET", "/sessions", token))[0] == 401, i
            status, body = await call(http, admins, 2, "POST", "/auth/login",
                                      json={"username": "ops", "password": "second-password"})
            assert status == 200, body
            second = body["token"]
            write(original)  # removed
            for i in (1, 2):
                assert (await call(http, admins, i, "GET", "/sessions", second))[0] == 401, i
            admin = await login(http, admins, 1)  # the others are untouched
            assert (await call(http, admins, 2, "GET", "/sessions", admin))[0] == 200
        finally:
            write(original)


async def test_a_viewer_reads_and_is_refused_every_change_until_the_file_makes_it_an_admin(admins):
    """Roles (`username:hash:viewer`): a viewer's token reads on both instances and gets 403 on every change
    and on the credentials; the role is looked up in the users file at each request, so changing it there
    applies to the token it already has, on both instances, without a restart."""
    users = admins.admin_users_file
    original = users.read_text()

    write = functools.partial(write_users, users)
    digest = PasswordHasher().hash("viewer-password")
    rule = {"kind": "client_id", "value": "viewer-test-device", "reason": "roles test"}
    async with aiohttp.ClientSession() as http:
        try:
            write(original + f"watch:{digest}:viewer\n")
            status, body = await call(http, admins, 1, "POST", "/auth/login",
                                      json={"username": "watch", "password": "viewer-password"})
            assert status == 200 and body["role"] == "viewer", body
            token = body["token"]
            for i in (1, 2):
                for path in ("/sessions", "/subscriptions", "/retained", "/blocked", "/services", "/overview"):
                    assert (await call(http, admins, i, "GET", path, token))[0] == 200, (i, path)
                status, body = await call(http, admins, i, "GET", "/credentials", token)
                assert status == 403 and "needs the admin role" in body["error"], (i, body)
                for method, path, payload in (("POST", "/blocked", rule), ("DELETE", "/retained/a%2Fb", None),
                                              ("PUT", "/credentials/x", {"password": "p"}),
                                              ("POST", "/sessions/x/disconnect", None)):
                    assert (await call(http, admins, i, method, path, token, payload))[0] == 403, (i, method, path)
            status, body = await call(http, admins, 1, "GET", "/blocked", token)
            assert "client_id:viewer-test-device" not in {b["key"] for b in body["items"]}  # nothing was written
            write(original + f"watch:{digest}:admin\n")  # the same user made an administrator
            for i in (1, 2):
                assert (await call(http, admins, i, "GET", "/credentials", token))[0] == 200, i
            assert (await call(http, admins, 2, "POST", "/blocked", token, rule))[0] == 202

            async def unblocked() -> bool:  # 404 until instance 2 has read its own rule back from the topic
                return (await call(http, admins, 2, "DELETE", "/blocked/client_id:viewer-test-device", token))[0] == 202

            await wait_until(unblocked, BOUND, "the rule deleted by the new administrator")
        finally:
            write(original)
