"""admin's pure parts: filters and paging of the tables, shared groups, statistics windows, token expiry on an
injected clock, the users file, and the OpenAPI document generated from the one route table."""

from __future__ import annotations

import re

import pytest
from admin import query
from admin.api import PREFIX, ROUTES, openapi
from admin.auth import ADMIN, ROLES, VIEWER, Tokens, User, allows, parse_users, password_stamp, token_user, verify
from admin.settings import endpoints, load_settings
from argon2 import PasswordHasher
from tbmq.v1 import messages_pb2 as pb
from tbmq_platform.settings import SettingsError

pytestmark = pytest.mark.unit

APP, DEV = pb.CLIENT_TYPE_APPLICATION, pb.CLIENT_TYPE_DEVICE


def sessions() -> dict[str, query.SessionRow]:
    """The table as the service keeps it: records of tbmq.client.session parsed into rows."""
    rows = [("dev-1", DEV, True), ("dev-2", DEV, False), ("app-1", APP, True), ("dev-3", DEV, True)]
    return {cid: query.SessionRow.parse(pb.SessionInfo(client_id=cid, client_type=t, connected=c).SerializeToString())
            for cid, t, c in rows}


def test_a_session_row_keeps_what_the_api_shows_and_the_writes_need():
    info = pb.SessionInfo(client_id="dev-9", service_id="connector-2", session_id="s-1", client_type=APP,
                          connected=True, clean_start=True, persistent=True, session_expiry_interval=3600,
                          mqtt_version=5, keep_alive=30, connected_at_ms=1_796_000_000_123,
                          disconnected_at_ms=1_796_000_000_999, client_address="10.0.0.7:40001", username="fleet",
                          connector_incarnation="inc-7", last_request_id="r-1", awaiting_pubrel=[3, 4])
    row = query.SessionRow.parse(info.SerializeToString())
    assert query.session_json(row) == query.session_json(info)
    shown = query.session_json(row)
    assert shown["client_address"] == "10.0.0.7:40001" and shown["username"] == "fleet"
    # the disconnect and clear commands name the session by these
    assert (row.service_id, row.session_id, row.connector_incarnation) == ("connector-2", "s-1", "inc-7")
    assert not hasattr(row, "__dict__")  # slots: what keeps a row small


def test_sessions_filter_by_prefix_connected_and_type_sorted():
    s = sessions()
    ids = lambda params: [x["client_id"] for x in query.filter_sessions(s, params)]  # noqa: E731
    assert ids({}) == ["app-1", "dev-1", "dev-2", "dev-3"]
    assert ids({"client_id": "dev"}) == ["dev-1", "dev-2", "dev-3"]
    assert ids({"client_id": "dev", "connected": "true"}) == ["dev-1", "dev-3"]
    assert ids({"connected": "false"}) == ["dev-2"]
    assert ids({"client_type": "application"}) == ["app-1"]
    with pytest.raises(query.BadQuery, match="client_type"):
        ids({"client_type": "ROBOT"})
    with pytest.raises(query.BadQuery, match="connected"):
        ids({"connected": "maybe"})


def test_paging_limit_offset_and_next_offset():
    items = list(range(7))
    first = query.Page.of({"limit": "3"}).apply(items)
    assert first == {"items": [0, 1, 2], "total": 7, "limit": 3, "offset": 0, "next_offset": 3}
    last = query.Page.of({"limit": "3", "offset": "6"}).apply(items)
    assert last["items"] == [6] and last["next_offset"] is None
    assert query.Page.of({"offset": "10"}).apply(items)["items"] == []
    assert query.Page.of({}).limit == query.DEFAULT_LIMIT
    for bad in ({"limit": "0"}, {"limit": "1001"}, {"offset": "-1"}, {"limit": "x"}):
        with pytest.raises(query.BadQuery):
            query.Page.of(bad)


def subs() -> dict[str, query.SubscriptionsRow]:
    def t(f, share="", qos=0):
        return pb.TopicSubscription(topic_filter=f, share_name=share, qos=qos)
    sets = {"a": pb.ClientSubscriptions(client_id="a", subscriptions=[t("s/+/temp", qos=1), t("j/#", "g1")]),
            "b": pb.ClientSubscriptions(client_id="b", subscriptions=[t("j/#", "g1", 2), t("x", "g2")])}
    return {cid: query.SubscriptionsRow.parse(c.SerializeToString()) for cid, c in sets.items()}  # as kept


def test_subscription_filter_and_shared_groups():
    flt = [(x["client_id"], x["topic_filter"]) for x in query.filter_subscriptions(subs(), {"topic_filter": "temp"})]
    assert flt == [("a", "s/+/temp")]
    assert len(query.filter_subscriptions(subs(), {})) == 4
    assert [x["client_id"] for x in query.filter_subscriptions(subs(), {"shared": "true"})] == ["a", "b", "b"]
    groups = query.shared_groups(subs())
    assert groups == [{"share_name": "g1", "topic_filter": "j/#", "members": [{"client_id": "a", "qos": 0},
                                                                             {"client_id": "b", "qos": 2}]},
                      {"share_name": "g2", "topic_filter": "x", "members": [{"client_id": "b", "qos": 0}]}]
    o = query.overview(sessions(), subs(), {})
    assert (o["sessions"], o["connected"], o["subscriptions"], o["shared_groups"]) == (4, 3, 4, 2)
    # the overview counts the groups without listing them; one more member of g2 is not one more group
    more = subs()
    more["c"] = query.SubscriptionsRow.parse(pb.ClientSubscriptions(client_id="c", subscriptions=[
        pb.TopicSubscription(topic_filter="x", share_name="g2"),
        pb.TopicSubscription(topic_filter="y", share_name="g2"), pb.TopicSubscription(topic_filter="x")]
    ).SerializeToString())
    assert query.overview(sessions(), more, {})["shared_groups"] == len(query.shared_groups(more)) == 3


def test_a_subscription_row_keeps_every_field_the_api_shows():
    t = pb.TopicSubscription(topic_filter="a/+/b", qos=2, share_name="g", no_local=True, retain_as_published=True,
                             retain_handling=pb.RETAIN_HANDLING_SEND_IF_NOT_EXISTS, subscription_id=7)
    (row,) = query.SubscriptionsRow.parse(
        pb.ClientSubscriptions(client_id="c", subscriptions=[t]).SerializeToString()).subscriptions
    assert query.subscription_json("c", row) == query.subscription_json("c", t)
    assert not hasattr(row, "__dict__")


def test_retained_listing_text_and_binary_payloads():
    r = {"a/b": pb.PublishMsg(topic="a/b", payload=b"on", qos=1),
         "z": pb.PublishMsg(topic="z", payload=b"\xff\x00")}
    out = query.filter_retained(r, {})
    assert [(m["topic"], m["payload_text"], m["payload_hex"]) for m in out] == [("a/b", "on", None),
                                                                                ("z", None, "ff00")]
    assert [m["topic"] for m in query.filter_retained(r, {"topic": "a/"})] == ["a/b"]


def test_stats_windows_totals_dimensions_newest_last():
    def w(start, n):
        return pb.UsageStats(source="spark-stats", window_start_ms=start, window_end_ms=start + 60_000,
                             stats=[pb.UsageStat(key="incoming_msgs", value=n),
                                    pb.UsageStat(key="incoming_msgs", dimension="qos=1", value=n - 1)])
    windows = {s: w(s, i + 2) for i, s in enumerate((60_000, 180_000, 120_000))}
    out = query.stats_json(windows)
    assert [x["window_start_ms"] for x in out] == [60_000, 120_000, 180_000]
    assert out[0]["totals"] == {"incoming_msgs": 2} and out[0]["dimensions"] == {"incoming_msgs": {"qos=1": 1}}
    assert [x["window_start_ms"] for x in query.stats_json(windows, since_ms=100_000, limit=1)] == [180_000]


def subject(tokens: Tokens, token: str) -> str | None:
    """The user a token names while it is valid (signature, expiry, revocation), else None."""
    claims = tokens.claims(token)
    return claims["sub"] if claims is not None else None


def test_token_expires_on_the_injected_clock():
    now = [1_800_000_000.0]
    tokens = Tokens(ttl_s=60, secret=b"k" * 32, clock=lambda: now[0])
    token, ttl = tokens.issue("admin")
    assert ttl == 60 and len(token) >= 40
    now[0] += 59.9
    assert subject(tokens, token) == "admin"
    now[0] += 0.1
    assert subject(tokens, token) is None
    other, _ = tokens.issue("admin")
    assert other != token and subject(tokens, "forged") is None


def test_a_token_works_on_every_instance_with_the_secret_until_revoked_anywhere():
    """ADMIN_TOKEN_SECRET shared: instance b takes a's token; a logout's revocation (what b reads from
    tbmq.admin.tokens.revoked) refuses it before its expiry; another secret or a changed token never passes."""
    now = [1_800_000_000.0]
    a, b = (Tokens(ttl_s=600, secret=b"shared-secret-of-32-bytes-or-more", clock=lambda: now[0]) for _ in "ab")
    stranger = Tokens(ttl_s=600, secret=b"another-secret-of-32-bytes-or-more", clock=lambda: now[0])
    token, _ = a.issue("ops")
    assert subject(b, token) == "ops" and subject(stranger, token) is None
    head, body, sig = token.split(".")
    assert subject(b, f"{head}.{body}.{sig[:-2]}xx") is None
    claims = a.claims(token)
    assert claims["sub"] == "ops" and claims["exp"] == 1_800_000_600
    b.revoke(claims["jti"], claims["exp"])
    assert subject(b, token) is None and subject(a, token) == "ops" and len(b) == 1
    now[0] += 600
    assert len(b) == 0  # forgotten once the token has expired anyway
    with pytest.raises(ValueError, match="32 bytes"):
        Tokens(ttl_s=60, secret=b"short")


def test_users_file_and_argon2id_verification():
    digest = PasswordHasher().hash("s3cret")
    assert digest.startswith("$argon2id$")
    users = parse_users(f"# admins\n\nadmin:{digest}\n")
    assert verify(users, "admin", "s3cret")
    assert not verify(users, "admin", "wrong") and not verify(users, "nobody", "s3cret")
    with pytest.raises(ValueError, match="line 1"):
        parse_users("admin:plaintext")


def test_users_have_a_role_admin_by_default_and_a_viewer_only_reads():
    digest = PasswordHasher().hash("s3cret")
    users = parse_users(f"root:{digest}\nops:{digest}:admin\nwatch:{digest}:viewer\n")
    assert [users[u].role for u in ("root", "ops", "watch")] == [ADMIN, ADMIN, VIEWER]
    assert users["watch"].digest == digest and verify(users, "watch", "s3cret")
    with pytest.raises(ValueError, match="line 2: role 'root' is not one of admin, viewer"):
        parse_users(f"ops:{digest}\nwatch:{digest}:root\n")
    assert allows(ADMIN, ADMIN) and allows(ADMIN, VIEWER) and allows(VIEWER, VIEWER)
    assert not allows(VIEWER, ADMIN) and not allows("root", VIEWER) and not allows(ADMIN, "root")
    assert ROLES == (ADMIN, VIEWER)


def test_every_route_that_changes_something_or_shows_credentials_needs_the_admin_role():
    for r in ROUTES:
        if not r.auth:
            continue
        reads = r.method == "GET" and not r.path.startswith("/credentials")
        assert r.role == (VIEWER if reads or r.handler == "logout" else ADMIN), (r.method, r.path)
        op = openapi()["paths"][PREFIX + r.path][r.method.lower()]
        assert op["x-role"] == r.role and ("403" in op["responses"]) == (r.role == ADMIN), r.path


def test_openapi_lists_every_route_with_its_parameters():
    doc = openapi()
    assert doc["openapi"].startswith("3.")
    ops = {(m.upper(), p) for p, methods in doc["paths"].items() for m in methods}
    assert ops == {(r.method, PREFIX + r.path) for r in ROUTES}
    for r in ROUTES:
        op = doc["paths"][PREFIX + r.path][r.method.lower()]
        declared = {p["name"] for p in op.get("parameters", []) if p["in"] == "path"}
        assert declared == set(re.findall(r"{(\w+)}", r.path)), r.path
        assert ("security" in op) == r.auth and ("401" in op["responses"]) == (r.auth or r.path == "/auth/login")
    # every resource of the brief has its route
    for path in ("/sessions", "/subscriptions", "/shared-subscriptions", "/retained", "/applications", "/services",
                 "/stats", "/auth/login"):
        assert PREFIX + path in doc["paths"], path


def test_settings_need_a_private_users_file_and_parse_service_endpoints(tmp_path):
    assert endpoints("router=127.0.0.1:8082, connector=h:1") == (("router", "127.0.0.1:8082"), ("connector", "h:1"))
    with pytest.raises(ValueError):
        endpoints("router:8082")
    users = tmp_path / "users"
    users.write_text("")
    users.chmod(0o644)
    with pytest.raises(SettingsError) as e:
        load_settings({"ADMIN_USERS_FILE": str(users), "ADMIN_HTTP_PORT": "x"})
    assert "ADMIN_HTTP_PORT" in str(e.value)
    with pytest.raises(SettingsError, match="chmod 600"):
        load_settings({"ADMIN_USERS_FILE": str(users)})
    users.chmod(0o600)
    s = load_settings({"ADMIN_USERS_FILE": str(users)})
    assert (s.http_host, s.http_port, s.health_port, s.service_name) == ("127.0.0.1", 8080, 8088, "admin")
    with pytest.raises(SettingsError, match="ADMIN_USERS_FILE is required"):
        load_settings({})
    with pytest.raises(SettingsError, match="ADMIN_TOKEN_SECRET: at least 32 bytes"):
        load_settings({"ADMIN_USERS_FILE": str(users), "ADMIN_TOKEN_SECRET": "short"})
    assert load_settings({"ADMIN_USERS_FILE": str(users), "ADMIN_TOKEN_SECRET": "s" * 32}).token_secret == "s" * 32


def test_a_token_ends_with_its_users_password_and_the_secret_rotates_without_a_logout():
    """`token_user`: the user removed from the users file, or its password changed, ends the tokens issued
    before; ADMIN_TOKEN_SECRET_PREVIOUS keeps the old secret's tokens valid while the new one signs."""
    now = [1_800_000_000.0]
    digest = PasswordHasher().hash("s3cret")
    users = {"ops": User(digest)}
    old = Tokens(ttl_s=600, secret=b"the-old-secret-of-32-bytes-or-more", clock=lambda: now[0])
    token, _ = old.issue("ops", password_stamp(digest))
    assert token_user(old.claims(token), users) == "ops"
    assert token_user(old.claims(token), {}) is None  # removed from the file
    assert token_user(old.claims(token), {"ops": User(PasswordHasher().hash("n3w"))}) is None  # password changed
    assert token_user(old.claims(old.issue("ops")[0]), users) is None  # a token without the stamp
    assert token_user(None, users) is None
    rotated = Tokens(ttl_s=600, secret=b"the-new-secret-of-32-bytes-or-more", clock=lambda: now[0],
                     previous=(b"the-old-secret-of-32-bytes-or-more",))
    assert token_user(rotated.claims(token), users) == "ops"  # the old secret's token still taken
    fresh, _ = rotated.issue("ops", password_stamp(digest))
    assert old.claims(fresh) is None and rotated.claims(fresh)["sub"] == "ops"  # signed with the new one
    assert Tokens(ttl_s=600, secret=b"the-new-secret-of-32-bytes-or-more").claims(token) is None
    now[0] += 600
    assert rotated.claims(token) is None  # expired under either secret
    with pytest.raises(ValueError, match="32 bytes"):
        Tokens(ttl_s=60, secret=b"k" * 32, previous=(b"short",))


def test_previous_token_secrets_are_checked_at_start_up(tmp_path):
    users = tmp_path / "users"
    users.write_text("")
    users.chmod(0o600)
    base = {"ADMIN_USERS_FILE": str(users)}
    for environ, text in [
        ({**base, "ADMIN_TOKEN_SECRET_PREVIOUS": "p" * 32}, "ADMIN_TOKEN_SECRET_PREVIOUS is used with"),
        ({**base, "ADMIN_TOKEN_SECRET": "s" * 32, "ADMIN_TOKEN_SECRET_PREVIOUS": f"{'p' * 32},short"},
         "ADMIN_TOKEN_SECRET_PREVIOUS: each at least 32 bytes"),
    ]:
        with pytest.raises(SettingsError) as e:
            load_settings(environ)
        assert text in str(e.value)
    ok = load_settings({**base, "ADMIN_TOKEN_SECRET": "s" * 32, "ADMIN_TOKEN_SECRET_PREVIOUS": "p" * 32})
    assert ok.token_secret_previous == ("p" * 32,)


def test_the_static_groups_are_the_default_groups_of_the_services_with_static_members(tmp_path):
    """ADMIN_STATIC_GROUPS defaults to the groups the three services join as static members unless renamed, and
    takes a comma list."""
    from router.settings import RouterSettings
    from session_registry.settings import SessionRegistrySettings
    from tbmq_device_persistence.settings import DevicePersistenceSettings
    from tbmq_platform.settings import load as load_service

    defaults = tuple(load_service(cls, {}).group_id
                     for cls in (RouterSettings, DevicePersistenceSettings, SessionRegistrySettings))
    assert defaults == ("router", "device-persistence", "session-registry")
    users = tmp_path / "users"
    users.write_text("")
    users.chmod(0o600)
    assert load_settings({"ADMIN_USERS_FILE": str(users)}).static_groups == defaults
    assert load_settings({"ADMIN_USERS_FILE": str(users), "ADMIN_STATIC_GROUPS": "r-east, dp-east"}).static_groups \
        == ("r-east", "dp-east")
