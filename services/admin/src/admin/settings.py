"""admin settings: environment variables parsed once (tbmq_platform.settings)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tbmq_platform.settings import (DEVICE_PERSISTENCE_GROUP, ROUTER_GROUP, SESSION_REGISTRY_GROUP, CommonSettings, csv,
                                    env, integer, load, load_or_exit, port)

from .auth import MIN_SECRET_BYTES, users_file_problem


def endpoints(raw: str) -> tuple[tuple[str, str], ...]:
    """ADMIN_SERVICES: comma list of `name=host:port` (a service's health endpoint; a name may repeat, one per
    instance)."""
    out = []
    for item in (i.strip() for i in raw.split(",")):
        if not item:
            continue
        name, sep, addr = item.partition("=")
        host, colon, p = addr.rpartition(":")
        if not sep or not name.strip() or not colon or not host or not p.isdigit() or not 0 < int(p) < 65536:
            raise ValueError(f"{item!r} is not name=host:port")
        out.append((name.strip(), addr.strip()))
    return tuple(out)


DEFAULT_SERVICES = ("session-registry=127.0.0.1:8086,device-persistence=127.0.0.1:8087,"
                    "app-delivery=127.0.0.1:8085,router=127.0.0.1:8082,connector=127.0.0.1:8081")


# the services' default group names (RouterSettings.group_id, DevicePersistenceSettings.group_id,
# SessionRegistrySettings.group_id)
DEFAULT_STATIC_GROUPS = (ROUTER_GROUP, DEVICE_PERSISTENCE_GROUP, SESSION_REGISTRY_GROUP)


@dataclass(frozen=True)
class AdminSettings(CommonSettings):
    service_name: str = "admin"
    health_port: int = env("HEALTH_PORT", 8088, parse=port, doc="health/readiness HTTP port (0 = any)")

    http_host: str = env("ADMIN_HTTP_HOST", "127.0.0.1", doc="address of the REST API and the web UI")
    http_port: int = env("ADMIN_HTTP_PORT", 8080, parse=port, doc="port of the REST API and the web UI (0 = any)")
    users_file: str = env("ADMIN_USERS_FILE", "",
                          doc="file of `username:argon2id-hash` lines, mode 0600 (required; make run writes "
                              ".run/admin-users)")
    token_ttl_s: int = env("ADMIN_TOKEN_TTL_S", 3600, parse=integer(60, 7 * 24 * 3600),
                           doc="lifetime of a login's bearer token (s)")
    token_secret: str = env(
        "ADMIN_TOKEN_SECRET", "",
        doc="the HMAC secret (at least 32 bytes) bearer tokens are signed with: the same on every admin instance, "
            "any of them takes a token any issued, also after a restart; empty = a random one per start (tokens "
            "work on this instance only, until it restarts)")
    token_secret_previous: tuple[str, ...] = env(
        "ADMIN_TOKEN_SECRET_PREVIOUS", (), parse=csv,
        doc="secrets tokens were signed with before ADMIN_TOKEN_SECRET (comma list): still accepted, never used to "
            "sign, so the secret is rotated without logging anyone out (drop them after ADMIN_TOKEN_TTL_S)")
    login_failures: int = env("ADMIN_LOGIN_FAILURES", 5, parse=integer(1, 1000),
                              doc="failed logins one client address may have in ADMIN_LOGIN_WINDOW_S (a token "
                                  "bucket refilled over the window, tbmq_auth.failures); the one that uses it up "
                                  "refuses the address's logins for the window (429)")
    login_window_s: int = env("ADMIN_LOGIN_WINDOW_S", 60, parse=integer(1, 86400),
                              doc="the window of ADMIN_LOGIN_FAILURES (s)")
    services: tuple[tuple[str, str], ...] = env(
        "ADMIN_SERVICES", endpoints(DEFAULT_SERVICES), parse=endpoints,
        doc="health endpoints of the suite's instances, `name=host:port,...` (GET /readyz of each)")
    static_groups: tuple[str, ...] = env(
        "ADMIN_STATIC_GROUPS", DEFAULT_STATIC_GROUPS, parse=csv,
        doc="the consumer groups whose members join as static members (TBMQ_KAFKA_STATIC_MEMBERSHIP): the routers' "
            "ROUTER_GROUP_ID, device-persistence's DEVICE_PERSISTENCE_GROUP_ID and the session registry's "
            "TBMQ_SESSION_REGISTRY_GROUP_ID (comma list); "
            "POST /api/v1/instances/{id}/leave-groups takes a stopped instance out of them")
    kafka_timeout_s: int = env("ADMIN_KAFKA_TIMEOUT_S", 10, parse=integer(1, 300),
                               doc="bound of one Kafka admin call (lag) and of a produce")

    def validate(self) -> list[str]:
        problems = super().validate()
        if not self.users_file:
            problems.append("ADMIN_USERS_FILE is required (a file of username:argon2-hash lines)")
        elif (problem := users_file_problem(self.users_file)) is not None:
            problems.append(f"ADMIN_USERS_FILE={self.users_file!r}: {problem}")
        if self.token_secret and len(self.token_secret.encode()) < MIN_SECRET_BYTES:
            problems.append(f"ADMIN_TOKEN_SECRET: at least {MIN_SECRET_BYTES} bytes (RFC 7518 3.2)")
        if self.token_secret_previous and not self.token_secret:
            problems.append("ADMIN_TOKEN_SECRET_PREVIOUS is used with ADMIN_TOKEN_SECRET only")
        if any(len(s.encode()) < MIN_SECRET_BYTES for s in self.token_secret_previous):
            problems.append(f"ADMIN_TOKEN_SECRET_PREVIOUS: each at least {MIN_SECRET_BYTES} bytes")
        return problems


def load_settings(environ: Mapping[str, str] | None = None, **overrides) -> AdminSettings:
    return load(AdminSettings, environ, **overrides)


def load_settings_or_exit(environ: Mapping[str, str] | None = None) -> AdminSettings:
    return load_or_exit(AdminSettings, environ)
