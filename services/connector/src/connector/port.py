"""What one connection needs from the connector service: the narrow interface `connection.Connection` runs
its machine's effects through. `service.ConnectorService` implements it; unit tests use a fake. Keeping it
here (not importing the service) is what keeps connection.py free of the service module."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Protocol

from tbmq.v1 import messages_pb2 as pb
from tbmq_connection import ConnectionMachine

if TYPE_CHECKING:
    from .connection import Connection
    from .settings import ConnectorSettings


class ConnectionPort(Protocol):
    settings: ConnectorSettings
    stats: Counter
    spans: bool                  # create the per-message spans (mqtt.publish)
    device: Any                  # grpc_clients.DevicePersistenceClient | None: fetch / acknowledge / detach

    def new_machine(self, address: str, peer_ip: str = "", cert_names: tuple[str, ...] = ()) -> ConnectionMachine:
        """The state machine of a new connection (the service's limits, stats, retained store and
        authorizer); `cert_names`: the verified client certificate's CN and SANs."""
    async def authenticate(self, request) -> Any:
        """tbmq_auth.AuthResult of a CONNECT's tbmq_auth.AuthRequest (a password verified off the loop)."""

    def admit(self, ip: str) -> str | None:
        """None when a new TCP connection from `ip` may go on, else why not (tbmq_connection.limits)."""

    # routing of what arrives for a connection (downlinks, forwards, disconnect commands)
    def connection_opened(self, conn: Connection) -> None: ...
    def connection_closed(self, conn: Connection) -> None:
        """Forget every route to `conn` (session, client, group stores)."""
    def route_session(self, session_id: str, conn: Connection) -> None: ...
    def route_client(self, client_id: str, conn: Connection) -> None: ...
    def route_store(self, store_id: str, conn: Connection) -> None: ...
    def unroute_store(self, store_id: str, conn: Connection) -> None: ...

    # Kafka and the session registry
    async def produce_publish(self, msg: pb.PublishMsg, topic: str, retain: bool, headers=None) -> tuple: ...
    async def produce_subscriptions(self, client_id: str, subs, client_type: int) -> None: ...
    async def request_session(self, session: pb.SessionInfo) -> pb.SessionEventResponse:
        """CONNECTION_REQUEST and its answer; raises TimeoutError after SESSION_EVENT_TIMEOUT_S."""
    def report_disconnect(self, session: pb.SessionInfo, graceful: bool, session_expiry: int | None,
                          awaiting_pubrel=()) -> None: ...
    async def subscriptions_of(self, client_id: str) -> dict: ...
    def retained_caught_up(self) -> Any:
        """A future done once the retained view holds every retained PUBLISH acknowledged before this call
        (bounded), or None when that wait is off."""

    # Wills, app-delivery, background jobs
    def session_started(self, client_id: str, clean_start: bool) -> None: ...
    def schedule_will(self, client_id: str, session_id: str, will, level: int, delay: int) -> None: ...
    def open_app_stream(self, opening, on_record, on_records): ...
    def spawn_bg(self, coro) -> None: ...


__all__ = ["ConnectionPort"]
