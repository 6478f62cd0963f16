"""The admin service: the REST API (api.ROUTES) and the web UI (static/) on aiohttp.

Reads: tbmq.client.session, tbmq.client.subscriptions, tbmq.msg.retained and tbmq.sys.historical.data followed
as tables on one CompactedViews consumer; Kafka lag of APPLICATION clients through the admin client; the other
services' /readyz. Writes only through the suite's own topics: a DisconnectCommand on the holding connector's
tbmq.client.disconnect.<svc>, a CLEAR_SESSION_REQUEST on tbmq.client.session.event.request (the session
registry's own request, as its expiry scan sends it), and the empty retained record on tbmq.msg.retained.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from pathlib import Path

from aiohttp import ClientSession, ClientTimeout, web
from tbmq.v1 import messages_pb2 as pb
from tbmq_platform import topics
from tbmq_platform.compacted import CompactedViews
from tbmq_auth import (CLIENT_ID, BlockedRule, Credential, make_credential, revocation, revocation_value,
                       revocations_in_force, revoked_until_ms)
from tbmq_auth.failures import LIFTED, FailedLogins, ban_record, bans_in_force, keep_ban
from tbmq_auth.passwords import STANDARD
from tbmq_platform.kafka import (ensure_topics, make_admin, make_consumer, make_producer, remove_static_members,
                                  topic_partitions)
from tbmq_platform.lifecycle import Service
from tbmq_platform.tracing import fresh_trace_headers
from tbmq_platform.watch import file_stamps
from tbmq_routing.naming import app_client_group, app_topic_name

from . import query
from .api import PREFIX, ROUTES, openapi
from .auth import User, Tokens, allows, load_users, password_stamp, token_user, users_file_problem, verify
from .settings import AdminSettings

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
READ = (topics.CLIENT_SESSION, topics.CLIENT_SUBSCRIPTIONS, topics.MSG_RETAINED, topics.SYS_HISTORICAL_DATA,
        topics.SECURITY_CREDENTIALS, topics.SECURITY_BLOCKED, topics.ADMIN_TOKENS_REVOKED, topics.SECURITY_LOGIN_BANS,
        topics.SECURITY_TOKENS_REVOKED)


def _json(data, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, dumps=lambda o: json.dumps(o, separators=(",", ":")))


def _error(status: int, message: str) -> web.Response:
    return _json({"error": message}, status)


def _keyed_table(table: dict, parse):
    """apply(key, value) keeping {key: parse(key, value)} (the tbmq_auth records); a tombstone or an unreadable
    record removes the key."""
    def apply(k: bytes | None, value: bytes | None) -> None:
        if k is None:
            return
        name = k.decode()
        try:
            table[name] = parse(name, value) if value else None
        except (ValueError, TypeError, AttributeError, KeyError):
            table[name] = None
        if table[name] is None:
            del table[name]
    return apply


def _table(table: dict, parse, key=bytes.decode):
    """apply(key, value) of a CompactedViews view keeping `table` {key(record key): parse(value)}; a tombstone (or
    an empty parsed record: a client's empty subscription set) removes the key."""
    def apply(k: bytes | None, value: bytes | None) -> None:
        if k is None:
            return
        item = parse(value) if value else None
        if item is not None and (not hasattr(item, "subscriptions") or item.subscriptions):
            table[key(k)] = item
        else:
            table.pop(key(k), None)
    return apply


class AdminService(Service):
    name = "admin"

    def __init__(self, settings: AdminSettings):
        super().__init__(settings)
        self.s = settings
        self.users = load_users(settings.users_file)
        self._users_seen = file_stamps([settings.users_file])
        self.tokens = Tokens(settings.token_ttl_s, settings.token_secret.encode() or secrets.token_bytes(32),
                             previous=tuple(s.encode() for s in settings.token_secret_previous))
        # ADMIN_LOGIN_FAILURES in a burst, refilled over the window; the last one bars the address that long
        self.failed_logins = FailedLogins(settings.login_failures, settings.login_window_s, settings.login_window_s)
        self.sessions: dict[str, query.SessionRow] = {}  # compact rows, not parsed protobufs
        self.subs: dict[str, query.SubscriptionsRow] = {}
        self.retained: dict[str, pb.PublishMsg] = {}
        self.windows: dict[int, pb.UsageStats] = {}
        self.credentials: dict[str, Credential] = {}   # tbmq.security.credentials (the tbmq CLI's store)
        self.blocked: dict[str, BlockedRule] = {}      # tbmq.security.blocked
        self.login_bans: dict[str, tuple[int, str]] = {}  # tbmq.security.login.bans: address -> (until_ms, by)
        self.revoked_tokens: dict[str, int] = {}  # tbmq.security.tokens.revoked: jti -> the token's exp, ms
        self.views: CompactedViews | None = None
        self.producer = None
        self.kadmin = None
        self.offsets = None  # a consumer without a group: end offsets of the APPLICATION topics
        self.http: ClientSession | None = None
        self.runner: web.AppRunner | None = None
        self.http_port: int | None = None
        self.counts = {"logins": 0, "logins_failed": 0, "logins_throttled": 0, "commands": 0, "forbidden": 0}
        self._routes = {r.handler: r for r in ROUTES}

    # -- lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        s = self.s
        await ensure_topics(s.bootstrap, [topics.spec(t) for t in (*READ, topics.SESSION_EVENT_REQUEST)],
                            layout=s.topic_layout)
        self.views = CompactedViews(s.bootstrap, client_id=f"{s.instance_id}-views")
        # tbmq.sys.historical.data: key = window start (Unix ms, decimal); the last record per key wins
        for topic, apply in zip(READ, (_table(self.sessions, query.SessionRow.parse),
                                       _table(self.subs, query.SubscriptionsRow.parse),
                                       _table(self.retained, pb.PublishMsg.FromString),
                                       _table(self.windows, pb.UsageStats.FromString, key=int),
                                       _keyed_table(self.credentials, Credential.from_json),
                                       _keyed_table(self.blocked, lambda _key, value: BlockedRule.from_json(value)),
                                       self._revoked, self._login_ban,
                                       _keyed_table(self.revoked_tokens, lambda _key, value: revoked_until_ms(value)))):
            self.views.view(topic, apply)
        await self.views.start()
        self.producer = make_producer(s.bootstrap, client_id=f"{s.instance_id}-commands")
        await self.producer.start()
        self.kadmin = make_admin(s.bootstrap, request_timeout_ms=s.kafka_timeout_s * 1000)
        await self.kadmin.start()
        self.offsets = make_consumer(s.bootstrap, group_id=None, client_id=f"{s.instance_id}-lag")
        await self.offsets.start()
        self.http = ClientSession(timeout=ClientTimeout(total=3))
        app = web.Application(middlewares=[self._auth])
        for r in ROUTES:
            app.router.add_route(r.method, PREFIX + r.path, getattr(self, r.handler), name=r.handler)
        app.router.add_get("/", self._index)
        app.router.add_static("/static/", STATIC)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, s.http_host, s.http_port)
        await site.start()
        self.http_port = site._server.sockets[0].getsockname()[1]
        log.info("admin API on http://%s:%d%s, web UI on http://%s:%d/", s.http_host, self.http_port, PREFIX,
                 s.http_host, self.http_port)

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.http is not None:
            await self.http.close()
        for c in (self.offsets, self.kadmin, self.producer):
            if c is not None:
                await (c.close() if c is self.kadmin else c.stop())
        if self.views is not None:
            await self.views.stop()

    def readiness_checks(self) -> dict:
        return {"views": self.views.problem}

    def health_details(self) -> dict:
        return {"http_port": self.http_port, "sessions": len(self.sessions), "subscribed_clients": len(self.subs),
                "retained": len(self.retained), "stat_windows": len(self.windows), "revoked_tokens": len(self.tokens),
                **self.counts}

    # -- HTTP plumbing --------------------------------------------------------------------------------
    @web.middleware
    async def _auth(self, request: web.Request, handler):
        """Every /api/v1 path but the public ones needs a valid token (401) of a user whose role allows the
        route (403, auth.allows, logged). Each change is logged by its handler with the user who made it."""
        route = self._routes.get(request.match_info.route.name or "")
        if request.path.startswith(PREFIX) and (route is None or route.auth):
            header = request.headers.get("Authorization", "")
            token = header[7:] if header.startswith("Bearer ") else ""
            users = self._current_users()
            user = token_user(self.tokens.claims(token), users) if token else None
            if user is None:
                return _error(401, "log in first: Authorization: Bearer <token> from POST /api/v1/auth/login")
            request["user"] = user
            if route is not None and not allows(users[user].role, route.role):
                self.counts["forbidden"] += 1
                log.warning("admin %r (role %s) refused %s %s: needs %s", user, users[user].role, request.method,
                            request.path, route.role)
                return _error(403, f"{request.method} {request.path} needs the {route.role} role")
        try:
            return await handler(request)
        except query.BadQuery as e:
            return _error(400, str(e))

    def _current_users(self) -> dict[str, User]:
        """ADMIN_USERS_FILE, read again when it changed (one stat per request): a user removed or a password
        changed takes effect at once, and ends that user's tokens (auth.token_user). A file that does not load
        (half written, no longer 0600) keeps the users read last."""
        path = self.s.users_file
        stamps = file_stamps([path])
        if stamps != self._users_seen:
            try:
                problem = users_file_problem(path)
                if problem is not None:
                    raise ValueError(problem)
                users = load_users(path)
            except (OSError, ValueError) as exc:
                log.warning("ADMIN_USERS_FILE=%r not loaded (%s): keeping %d users", path, exc, len(self.users))
            else:
                log.info("ADMIN_USERS_FILE read again: %d users", len(users))
                self.users = users
            self._users_seen = stamps
        return self.users

    async def _index(self, request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC / "index.html")

    # -- auth -----------------------------------------------------------------------------------------
    async def login(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            username, password = str(body["username"]), str(body["password"])
        except (ValueError, KeyError, TypeError):
            return _error(400, 'JSON body {"username": ..., "password": ...} expected')
        address = request.remote or ""
        wait = self.failed_logins.retry_after(address, time.monotonic())
        if wait:
            self.counts["logins_throttled"] += 1
            return web.json_response({"error": f"too many failed logins: retry in {wait:.0f} s"}, status=429,
                                     headers={"Retry-After": str(max(1, round(wait)))})
        # argon2 verification costs tens of ms of CPU: off the event loop
        users = self._current_users()
        if not await asyncio.to_thread(verify, users, username, password):
            self.failed_logins.failed(address, time.monotonic())
            self.counts["logins_failed"] += 1
            log.warning("failed admin login for %r from %s", username, request.remote)
            return _error(401, "bad user name or password")
        self.counts["logins"] += 1
        token, ttl = self.tokens.issue(username, password_stamp(users[username].digest))
        log.info("admin %r (role %s) logged in from %s", username, users[username].role, request.remote)
        return _json({"token": token, "token_type": "Bearer", "expires_in": ttl, "role": users[username].role})

    async def logout(self, request: web.Request) -> web.Response:
        """The request's token refused from now on, here at once and on every instance sharing the secret once
        it has read the record (acknowledged by Kafka before the answer)."""
        claims = self.tokens.claims(request.headers["Authorization"][7:])
        if claims is not None:
            self.tokens.revoke(claims["jti"], claims["exp"])
            await self._send(topics.ADMIN_TOKENS_REVOKED, claims["jti"], str(claims["exp"]).encode(), command=False)
        return _json({"ok": True})

    def _login_ban(self, key: bytes | None, value: bytes | None) -> None:
        """tbmq.security.login.bans: the last ban record of an address says until when it is banned (its failed
        logins, the topic's other records, are the connectors' to count)."""
        try:
            keep_ban(self.login_bans, key, value)
        except ValueError as exc:
            log.warning("tbmq.security.login.bans: %s", exc)

    def _revoked(self, key: bytes | None, value: bytes | None) -> None:
        """tbmq.admin.tokens.revoked: a logout on any instance."""
        if key is not None and value:
            try:
                self.tokens.revoke(key.decode(), float(value))
            except ValueError:
                log.warning("tbmq.admin.tokens.revoked: a record that is not an expiry (%r)", value[:40])

    async def openapi_doc(self, request: web.Request) -> web.Response:
        return _json(openapi())

    # -- reads ----------------------------------------------------------------------------------------
    async def overview(self, request: web.Request) -> web.Response:
        out = query.overview(self.sessions, self.subs, self.retained)
        msgs_in = msgs_out = 0
        for name, _addr, _ok, body in await self._readyz_all():
            if name == "connector" and isinstance(body, dict):
                msgs_in += sum(int(body.get(f"msgs_in_qos{q}", 0)) for q in range(3))
                msgs_out += sum(int(body.get(f"msgs_out_qos{q}", 0)) for q in range(3))
        out.update(messages_in_total=msgs_in, messages_out_total=msgs_out, time_ms=int(time.time() * 1000))
        apps = [cid for cid, s in self.sessions.items() if s.client_type == pb.CLIENT_TYPE_APPLICATION]
        lags = await asyncio.gather(*(self._app_lag(cid) for cid in apps[:200]))
        out["application_lag"] = sum(lag["lag"] or 0 for lag in lags)
        return _json(out)

    async def list_sessions(self, request: web.Request) -> web.Response:
        return _json(query.Page.of(request.query).apply(query.filter_sessions(self.sessions, request.query)))

    async def get_session(self, request: web.Request) -> web.Response:
        cid = request.match_info["client_id"]
        s = self.sessions.get(cid)
        if s is None:
            return _error(404, f"no session of {cid!r}")
        out = query.session_json(s)
        subs = self.subs.get(cid)
        out["subscriptions"] = [query.subscription_json(cid, t) for t in subs.subscriptions] if subs else []
        if s.client_type == pb.CLIENT_TYPE_APPLICATION:
            out["kafka"] = await self._app_lag(cid)
        return _json(out)

    async def list_subscriptions(self, request: web.Request) -> web.Response:
        return _json(query.Page.of(request.query).apply(query.filter_subscriptions(self.subs, request.query)))

    async def list_shared(self, request: web.Request) -> web.Response:
        return _json(query.Page.of(request.query).apply(query.shared_groups(self.subs)))

    async def list_retained(self, request: web.Request) -> web.Response:
        return _json(query.Page.of(request.query).apply(query.filter_retained(self.retained, request.query)))

    async def list_applications(self, request: web.Request) -> web.Response:
        page = query.Page.of(request.query)
        apps = query.filter_sessions(self.sessions, {"client_type": "APPLICATION"})
        out = page.apply(apps)
        lags = await asyncio.gather(*(self._app_lag(a["client_id"]) for a in out["items"]))
        for a, lag in zip(out["items"], lags):
            a["kafka"] = lag
        return _json(out)

    async def list_services(self, request: web.Request) -> web.Response:
        items = []
        for name, addr, ready, body in await self._readyz_all():
            items.append({"service": name, "address": addr, "ready": ready,
                          "instance": body.get("instance") if isinstance(body, dict) else None,
                          "health": body})
        return _json({"items": items, "all_ready": all(i["ready"] for i in items)})

    async def leave_groups(self, request: web.Request) -> web.Response:
        """POST /instances/{instance_id}/leave-groups: the stopped instance out of every static group it is in."""
        iid = request.match_info["instance_id"]
        # an instance whose health endpoint answers (ready or not) is running: taken out, it would be fenced and
        # join again, a rebalance for nothing
        running = [addr for _name, addr, _ready, body in await self._readyz_all()
                   if isinstance(body, dict) and body.get("instance") == iid]
        if running:
            return _error(409, f"{iid!r} is running (its health endpoint {', '.join(running)} answers): stop it "
                               "first")
        left = []
        for group in self.s.static_groups:
            try:
                async with asyncio.timeout(self.s.kafka_timeout_s):
                    removed = await remove_static_members(self.s.bootstrap, group, [iid], admin=self.kadmin)
            except Exception as e:  # noqa: BLE001 - Kafka's answer, or none: the caller may retry
                log.warning("admin %r: taking %r out of group %s failed: %r", request["user"], iid, group, e)
                return _error(503, f"taking {iid!r} out of group {group} failed: {e!r}"
                                   + (f" (taken out of {', '.join(left)} already)" if left else ""))
            if removed:
                left.append(group)
        if not left:
            return _error(404, f"{iid!r} is a static member of none of {', '.join(self.s.static_groups)}")
        log.info("admin %r took %r out of groups %s", request["user"], iid, ", ".join(left))
        return _json({"instance_id": iid, "groups": left})

    async def list_stats(self, request: web.Request) -> web.Response:
        since = query._int(request.query, "since_ms", 0, 0, None)
        limit = query._int(request.query, "limit", 1440, 1, 10080)
        return _json({"items": query.stats_json(self.windows, since, limit)})

    # -- writes (only the suite's own topics) ---------------------------------------------------------
    async def disconnect_session(self, request: web.Request) -> web.Response:
        cid = request.match_info["client_id"]
        s = self.sessions.get(cid)
        if s is None:
            return _error(404, f"no session of {cid!r}")
        if not s.connected:
            return _error(409, f"{cid!r} is not connected")
        # new_session_clean_start: the session does not continue on another connection, so the connector
        # sends the Will at once (tbmq_connection.machine) and reports the end to the registry
        cmd = pb.DisconnectCommand(client_id=cid, session_id=s.session_id, new_session_clean_start=True,
                                   reason=pb.DISCONNECT_REASON_ADMINISTRATIVE)
        await self._send(topics.disconnect_topic(s.service_id), cid, cmd.SerializeToString())
        log.info("admin %r disconnected %r (session %s on %s)", request["user"], cid, s.session_id, s.service_id)
        return _json({"client_id": cid, "session_id": s.session_id, "service_id": s.service_id}, 202)

    async def clear_session(self, request: web.Request) -> web.Response:
        cid = request.match_info["client_id"]
        s = self.sessions.get(cid)
        if s is None:
            return _error(404, f"no session of {cid!r}")
        # the request the registry's expiry scan sends (session_registry.logic.clear_request), forced: a
        # connected session is ended too (the registry disconnects it, v5 0x98)
        req = pb.SessionEventRequest(
            request_id=f"admin-{uuid.uuid4()}", type=pb.SESSION_EVENT_CLEAR_SESSION_REQUEST,
            session=pb.SessionInfo(client_id=cid, service_id=s.service_id, session_id=s.session_id,
                                   connector_incarnation=s.connector_incarnation),
            request_time_ms=int(time.time() * 1000), force_cleanup=True)
        await self._send(topics.SESSION_EVENT_REQUEST, cid, req.SerializeToString())
        log.info("admin %r cleared the session of %r", request["user"], cid)
        return _json({"client_id": cid, "request_id": req.request_id}, 202)

    async def delete_retained(self, request: web.Request) -> web.Response:
        topic = request.match_info["topic"]
        if topic not in self.retained:
            return _error(404, f"no retained message on {topic!r}")
        await self._send(topics.MSG_RETAINED, topic, None)  # the connectors' delete (tbmq_routing.wills)
        self.retained.pop(topic, None)  # the view applies the same record when it reads it
        log.info("admin %r deleted the retained message of %r", request["user"], topic)
        return _json({"topic": topic}, 202)

    # -- credentials and blocked clients (the store of the tbmq command line, docs/security.md) -------------
    async def list_credentials(self, request: web.Request) -> web.Response:
        items = [self.credentials[n].public() for n in sorted(self.credentials)]
        return _json(query.Page.of(request.query).apply(items))

    async def put_credential(self, request: web.Request) -> web.Response:
        name = request.match_info["username"]
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise TypeError
            password = body.get("password")
            # argon2id costs 186 ms of CPU at the standard cost: off the event loop
            cred = await asyncio.to_thread(
                make_credential, name, None if password is None else str(password),
                client_id=body.get("client_id"), cert_cn=body.get("cert_cn"),
                pub=[str(f) for f in body.get("pub") or ()], sub=[str(f) for f in body.get("sub") or ()],
                hash_cost=str(body.get("hash_cost") or STANDARD))
        except (ValueError, TypeError) as exc:
            return _error(400, f"credential not valid: {exc}" if str(exc) else "JSON object expected")
        await self._send(topics.SECURITY_CREDENTIALS, name, cred.to_json())
        self.credentials[name] = cred
        log.info("admin %r wrote the credential %r", request["user"], name)  # never the password or hash
        return _json(cred.public(), 202)

    async def delete_credential(self, request: web.Request) -> web.Response:
        name = request.match_info["username"]
        if name not in self.credentials:
            return _error(404, f"no credential {name!r}")
        await self._send(topics.SECURITY_CREDENTIALS, name, None)
        self.credentials.pop(name, None)
        log.info("admin %r deleted the credential %r", request["user"], name)
        return _json({"username": name}, 202)

    async def list_blocked(self, request: web.Request) -> web.Response:
        now = int(time.time() * 1000)
        items = [{**json.loads(self.blocked[k].to_json()), "key": k,
                  "active": self.blocked[k].expires_at_ms is None or now < self.blocked[k].expires_at_ms}
                 for k in sorted(self.blocked)]
        return _json(query.Page.of(request.query).apply(items))

    async def add_blocked(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            expires_in = body.get("expires_in_s")
            rule = BlockedRule(kind=str(body["kind"]), value=str(body["value"]),
                               target=str(body.get("target") or CLIENT_ID),
                               expires_at_ms=None if expires_in is None else
                               int(time.time() * 1000 + float(expires_in) * 1000),
                               reason=str(body.get("reason") or ""))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            return _error(400, f"blocked rule not valid: {exc}")
        await self._send(topics.SECURITY_BLOCKED, rule.key, rule.to_json())
        self.blocked[rule.key] = rule
        log.info("admin %r blocked %r", request["user"], rule.key)
        return _json({**json.loads(rule.to_json()), "key": rule.key}, 202)

    async def delete_blocked(self, request: web.Request) -> web.Response:
        key = request.match_info["key"]
        if key not in self.blocked:
            return _error(404, f"no blocked rule {key!r}")
        await self._send(topics.SECURITY_BLOCKED, key, None)
        self.blocked.pop(key, None)
        log.info("admin %r deleted the blocked rule %r", request["user"], key)
        return _json({"key": key}, 202)

    def _revocations_in_force(self) -> dict[str, int]:
        return revocations_in_force(self.revoked_tokens, time.time() * 1000)

    async def list_revoked_tokens(self, request: web.Request) -> web.Response:
        items = [{"jti": jti, "exp": until // 1000} for jti, until in self._revocations_in_force().items()]
        return _json(query.Page.of(request.query).apply(items))

    async def revoke_token(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("a JSON object")
            jti, exp = revocation(body.get("token"), body.get("jti"), body.get("exp"))
        except ValueError as exc:
            return _error(400, f"revocation not valid: {exc}")
        if exp <= time.time():
            return _error(400, f"token {jti!r} has expired: refused anyway, nothing written")
        await self._send(topics.SECURITY_TOKENS_REVOKED, jti, revocation_value(exp))
        self.revoked_tokens[jti] = int(exp) * 1000
        log.info("admin %r revoked the MQTT token %r", request["user"], jti)
        return _json({"jti": jti, "exp": int(exp)}, 202)

    async def withdraw_token_revocation(self, request: web.Request) -> web.Response:
        jti = request.match_info["jti"]
        if jti not in self._revocations_in_force():
            return _error(404, f"no revocation of token {jti!r} in force")
        await self._send(topics.SECURITY_TOKENS_REVOKED, jti, None)
        self.revoked_tokens.pop(jti, None)
        log.info("admin %r withdrew the revocation of the MQTT token %r", request["user"], jti)
        return _json({"jti": jti}, 202)

    async def list_login_bans(self, request: web.Request) -> web.Response:
        items = list(bans_in_force(self.login_bans, int(time.time() * 1000)).values())
        return _json(query.Page.of(request.query).apply(items))

    async def lift_login_ban(self, request: web.Request) -> web.Response:
        address = request.match_info["address"]
        if address not in bans_in_force(self.login_bans, int(time.time() * 1000)):
            return _error(404, f"no login ban of {address!r} in force")
        by = f"admin:{request['user']}"
        await self._send(topics.SECURITY_LOGIN_BANS, address, ban_record(LIFTED, by))
        self.login_bans[address] = (LIFTED, by)
        log.info("admin %r lifted the login ban of %s", request["user"], address)
        return _json({"address": address}, 202)

    async def _send(self, topic: str, key: str, value: bytes | None, command: bool = True) -> None:
        self.counts["commands"] += command
        async with asyncio.timeout(self.s.kafka_timeout_s):
            fut = await self.producer.send(topic, value, key=key.encode(), headers=fresh_trace_headers())
            await fut  # acknowledged (acks=all) before the API answers

    # -- Kafka lag, other services --------------------------------------------------------------------
    async def _app_lag(self, cid: str) -> dict:
        topic, group = app_topic_name(cid), app_client_group(cid)
        out = {"topic": topic, "group": group, "lag": None, "partitions": []}
        try:
            async with asyncio.timeout(self.s.kafka_timeout_s):
                tps = await topic_partitions(self.offsets, topic, attempts=2, interval_s=0)
                ends = await self.offsets.end_offsets(tps)
                begins = await self.offsets.beginning_offsets(tps)
                committed = await self.kadmin.list_consumer_group_offsets(group, partitions=tps)
        except RuntimeError:  # no topic (yet): nothing routed to this client
            out["lag"] = 0
            return out
        except Exception as e:  # noqa: BLE001 - reported in the answer, never a 500
            out["error"] = repr(e)
            return out
        total = 0
        for tp in tps:
            c = committed.get(tp)
            pos = c.offset if c is not None and c.offset >= 0 else begins[tp]
            lag = max(0, ends[tp] - max(pos, begins[tp]))
            total += lag
            out["partitions"].append({"partition": tp.partition, "committed": c.offset if c else None,
                                      "end": ends[tp], "lag": lag})
        out["lag"] = total
        return out

    async def _readyz_all(self) -> list[tuple[str, str, bool, dict | None]]:
        async def one(name: str, addr: str):
            try:
                async with self.http.get(f"http://{addr}/readyz") as r:
                    body = await r.json(content_type=None)
                    return name, addr, r.status == 200, body
            except Exception as e:  # noqa: BLE001 - down is an answer
                return name, addr, False, {"error": repr(e)}
        return list(await asyncio.gather(*(one(n, a) for n, a in self.s.services)))
