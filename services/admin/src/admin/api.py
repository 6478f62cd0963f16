"""The REST API's one table of routes (ROUTES) and the OpenAPI 3 document generated from it.

Each route names the AdminService handler method that answers it and the role it needs (auth.ROLES: `viewer`
for the reads, `admin`, the default, for every change and for the credentials); `openapi()` describes exactly
these routes, so the document and the server cannot disagree (tests/unit/admin checks every route is in it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .auth import ADMIN, VIEWER

PREFIX = "/api/v1"


@dataclass(frozen=True)
class Param:
    name: str
    where: str = "query"  # query | path
    type: str = "string"  # string | integer | boolean
    doc: str = ""


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # below PREFIX, aiohttp syntax: /sessions/{client_id}
    handler: str  # AdminService method name
    summary: str
    params: tuple[Param, ...] = ()
    auth: bool = True
    role: str = ADMIN  # the role a caller needs (auth.allows); a route that forgets it is for admins only
    body: dict | None = None  # JSON schema of the request body
    responses: dict = field(default_factory=lambda: {"200": "OK"})


PAGING = (Param("limit", type="integer", doc="page size, 1..1000 (default 100)"),
          Param("offset", type="integer", doc="items skipped (default 0); the answer's next_offset is the next page"))
CLIENT = Param("client_id", "path", doc="MQTT client id")

ROUTES: tuple[Route, ...] = (
    Route("POST", "/auth/login", "login", "Log in: a bearer token for the other endpoints", auth=False,
          body={"type": "object", "required": ["username", "password"],
                "properties": {"username": {"type": "string"}, "password": {"type": "string"}}},
          responses={"200": "{token, expires_in}", "401": "bad user name or password",
                     "429": "too many failed logins from this address (Retry-After)"}),
    Route("POST", "/auth/logout", "logout", "Revoke the bearer token of the request", role=VIEWER),
    Route("GET", "/openapi.json", "openapi_doc", "This document", auth=False),
    Route("GET", "/overview", "overview", "Counts of sessions, connections, subscriptions, retained messages; "
          "connector message counters; the APPLICATION clients' total Kafka lag", role=VIEWER),
    Route("GET", "/sessions", "list_sessions", "Sessions (tbmq.client.session), sorted by client id",
          (Param("client_id", doc="client id prefix"), Param("connected", type="boolean"),
           Param("client_type", doc="DEVICE or APPLICATION"), *PAGING), role=VIEWER),
    Route("GET", "/sessions/{client_id}", "get_session", "One session, its subscriptions and, for an "
          "APPLICATION client, its Kafka backlog", (CLIENT,), role=VIEWER,
          responses={"200": "OK", "404": "no such session"}),
    Route("POST", "/sessions/{client_id}/disconnect", "disconnect_session",
          "Close the client's connection (v5 DISCONNECT 0x98 Administrative action; its Will is sent at once)",
          (CLIENT,), responses={"202": "DisconnectCommand sent", "404": "no such session", "409": "not connected"}),
    Route("DELETE", "/sessions/{client_id}", "clear_session",
          "Clear the session (CLEAR_SESSION_REQUEST to the session registry; a connected client is disconnected "
          "first)", (CLIENT,), responses={"202": "request sent", "404": "no such session"}),
    Route("GET", "/subscriptions", "list_subscriptions", "Subscriptions (tbmq.client.subscriptions)",
          (Param("topic_filter", doc="substring of the topic filter"), Param("client_id", doc="client id prefix"),
           Param("shared", type="boolean"), *PAGING), role=VIEWER),
    Route("GET", "/shared-subscriptions", "list_shared", "Shared-subscription groups: share name, filter, members",
          PAGING, role=VIEWER),
    Route("GET", "/retained", "list_retained", "Retained messages (tbmq.msg.retained)",
          (Param("topic", doc="substring of the topic"), *PAGING), role=VIEWER),
    Route("DELETE", "/retained/{topic}", "delete_retained", "Delete a retained message (the empty retained "
          "record the connectors apply); the topic URL-encoded (%2F for /)", (Param("topic", "path"),),
          responses={"202": "deletion written", "404": "no retained message on this topic"}),
    Route("GET", "/applications", "list_applications", "APPLICATION clients with their Kafka lag", PAGING, role=VIEWER),
    Route("GET", "/services", "list_services", "The suite's services and instances with their readiness "
          "(GET /readyz of each ADMIN_SERVICES endpoint)", role=VIEWER),
    Route("POST", "/instances/{instance_id}/leave-groups", "leave_groups",
          "Take a router, device-persistence or session-registry instance that was stopped for good (scaled down) "
          "out of its consumer groups (ADMIN_STATIC_GROUPS). A stopped static member (TBMQ_KAFKA_STATIC_MEMBERSHIP) keeps its partitions "
          "until its session times out, waiting for a restart; after this the other instances take them over at once",
          (Param("instance_id", "path", doc="the instance's TBMQ_SERVICE_ID"),),
          responses={"200": "{instance_id, groups}: the groups it was taken out of",
                     "404": "a member of none of them (never joined, already taken out, or its session expired)",
                     "409": "the instance is running (its ADMIN_SERVICES health endpoint answers): stop it first",
                     "503": "Kafka refused or did not answer (ADMIN_KAFKA_TIMEOUT_S); nothing more was changed"}),
    Route("GET", "/credentials", "list_credentials", "MQTT credentials (tbmq.security.credentials, the store of the "
          "tbmq command line); never the password hash", PAGING),
    Route("PUT", "/credentials/{username}", "put_credential", "Write (create or replace) a credential; the "
          "password is hashed (argon2id) and never stored or logged", (Param("username", "path"),),
          body={"type": "object", "properties": {
              "password": {"type": "string"}, "client_id": {"type": "string", "description": "client-id pattern"},
              "hash_cost": {"type": "string", "enum": ["standard", "low"],
                            "description": "argon2id parameters of the password's hash (default standard)"},
              "cert_cn": {"type": "string"}, "pub": {"type": "array", "items": {"type": "string"}},
              "sub": {"type": "array", "items": {"type": "string"}}}},
          responses={"202": "written", "400": "not valid"}),
    Route("DELETE", "/credentials/{username}", "delete_credential", "Delete a credential",
          (Param("username", "path"),), responses={"202": "deleted", "404": "no such credential"}),
    Route("GET", "/blocked", "list_blocked", "Blocked clients (tbmq.security.blocked), with whether each rule is "
          "active", PAGING, role=VIEWER),
    Route("POST", "/blocked", "add_blocked", "Block clients: kind client_id | username | ip | regex (with target)",
          body={"type": "object", "required": ["kind", "value"], "properties": {
              "kind": {"type": "string"}, "value": {"type": "string"}, "target": {"type": "string"},
              "expires_in_s": {"type": "number"}, "reason": {"type": "string"}}},
          responses={"202": "written", "400": "not valid"}),
    Route("DELETE", "/blocked/{key}", "delete_blocked", "Delete a blocked rule (its key: <kind>:<value>)",
          (Param("key", "path"),), responses={"202": "deleted", "404": "no such rule"}),
    Route("GET", "/revoked-tokens", "list_revoked_tokens", "MQTT JSON Web Tokens revoked before their exp "
          "(tbmq.security.tokens.revoked), those not expired yet", PAGING, role=VIEWER),
    Route("POST", "/revoked-tokens", "revoke_token", "Revoke an MQTT token (provider jwt) by its jti: every connector "
          "refuses it and closes its connections until its exp. The token itself, or its jti with its exp",
          body={"type": "object", "properties": {
              "token": {"type": "string"}, "jti": {"type": "string"},
              "exp": {"type": "number", "description": "the token's exp claim, Unix seconds"}}},
          responses={"202": "written", "400": "not valid, or the token has expired"}),
    Route("DELETE", "/revoked-tokens/{jti}", "withdraw_token_revocation", "Withdraw a token's revocation",
          (Param("jti", "path"),), responses={"202": "withdrawn", "404": "no revocation of this token in force"}),
    Route("GET", "/login-bans", "list_login_bans", "Addresses banned for failed MQTT logins "
          "(tbmq.security.login.bans, MQTT_LOGIN_FAILURES_PER_IP) while the ban lasts", PAGING, role=VIEWER),
    Route("DELETE", "/login-bans/{address}", "lift_login_ban", "Lift an address's login ban on every connector",
          (Param("address", "path"),), responses={"202": "lifted", "404": "no ban of this address in force"}),
    Route("GET", "/stats", "list_stats", "Per-window usage statistics (tbmq.sys.historical.data, docs/spark.md)",
          (Param("since_ms", type="integer", doc="windows starting at or after (Unix ms)"),
           Param("limit", type="integer", doc="newest windows, 1..10080 (default 1440)")), role=VIEWER),
)


def openapi() -> dict:
    """The OpenAPI 3.0 document of ROUTES."""
    paths: dict[str, dict] = {}
    for r in ROUTES:
        op: dict = {"operationId": r.handler, "summary": r.summary,
                    "responses": {code: {"description": text} for code, text in r.responses.items()}}
        if r.params:
            op["parameters"] = [{"name": p.name, "in": p.where, "required": p.where == "path",
                                 "schema": {"type": p.type}, **({"description": p.doc} if p.doc else {})}
                                for p in r.params]
        if r.body:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": r.body}}}
        if r.auth:
            op["security"] = [{"bearer": []}]
            op["responses"].setdefault("401", {"description": "no or an expired bearer token"})
            op["x-role"] = r.role
            if r.role != VIEWER:
                op["responses"].setdefault("403", {"description": f"the user's role is not {r.role}"})
        paths.setdefault(PREFIX + r.path, {})[r.method.lower()] = op
    return {"openapi": "3.0.3",
            "info": {"title": "tbmq-py admin API", "version": "1",
                     "description": "Sessions, subscriptions, retained messages, APPLICATION clients, services "
                                    "and statistics of a tbmq-py suite (docs/operations.md)."},
            "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
            "paths": paths}
