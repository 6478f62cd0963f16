"""Session events: CONNECTION_REQUEST / DISCONNECTION_REQUEST to the session registry, answers correlated by
request id on tbmq.client.session.event.response.<svc>.

Inbound QoS 2 state travels with them: a DISCONNECTION_REQUEST reports the packet ids whose PUBLISH Kafka
acknowledged and the client has not released (``tbmq_connection`` decides which: ``ReportDisconnect``); the registry keeps them with a
persistent session and the answer of the CONNECT that resumes it hands them back, so a PUBLISH the client
re-sends with one of them is answered PUBREC and not forwarded again [MQTT-4.3.3-10]. An id whose PUBLISH was
not yet acknowledged by Kafka is never reported: its re-sent PUBLISH is produced again (at worst a duplicate,
never a loss). A connector crash reports nothing (the same: at worst one duplicate per id).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager

from aiokafka import AIOKafkaProducer
from tbmq.v1 import messages_pb2 as pb
from tbmq_platform.topics import SESSION_EVENT_REQUEST
from tbmq_platform.tracing import kafka_headers

log = logging.getLogger(__name__)


class SessionEvents:
    def __init__(self, producer: AIOKafkaProducer, incarnation: str = "",
                 urgent: Callable[[], AbstractContextManager] = contextlib.nullcontext) -> None:
        self._producer = producer
        self._urgent = urgent  # around a CONNECT's request: the producer's adaptive linger (no busy window)
        # this connector run (ConnectorHeartbeat.incarnation): stamped on every request, so that the registry
        # refuses the CONNECTs of a run it declared dead (fencing)
        self._incarnation = incarnation
        self._pending: dict[str, asyncio.Future] = {}

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def connect(self, session: pb.SessionInfo, timeout: float) -> pb.SessionEventResponse:
        """Ask the registry; raises asyncio.TimeoutError when no answer comes in `timeout` seconds."""
        request_id = uuid.uuid4().hex
        session.connector_incarnation = self._incarnation
        fut = asyncio.get_running_loop().create_future()
        self._pending[request_id] = fut
        try:
            req = pb.SessionEventRequest(request_id=request_id, type=pb.SESSION_EVENT_CONNECTION_REQUEST,
                                         session=session, request_time_ms=int(time.time() * 1000))
            async with asyncio.timeout(timeout):
                with self._urgent():
                    sent = await self._producer.send(SESSION_EVENT_REQUEST, req.SerializeToString(),
                                                     key=session.client_id.encode(), headers=kafka_headers())
                await sent
                return await fut
        finally:
            self._pending.pop(request_id, None)

    async def disconnect(self, session: pb.SessionInfo, *, graceful: bool, session_expiry: int | None = None,
                         awaiting_pubrel: Iterable[int] = ()) -> asyncio.Future:
        """Produce a DISCONNECTION_REQUEST; returns the delivery future (nobody needs to wait for the
        answer)."""
        session.connector_incarnation = self._incarnation
        req = pb.SessionEventRequest(request_id=uuid.uuid4().hex, type=pb.SESSION_EVENT_DISCONNECTION_REQUEST,
                                     session=session, request_time_ms=int(time.time() * 1000),
                                     graceful=graceful, awaiting_pubrel=awaiting_pubrel)
        if session_expiry is not None:
            req.disconnect_session_expiry_interval = session_expiry
        return await self._producer.send(SESSION_EVENT_REQUEST, req.SerializeToString(),
                                         key=session.client_id.encode(), headers=kafka_headers())

    def on_response(self, value: bytes) -> None:
        resp = pb.SessionEventResponse.FromString(value)
        fut = self._pending.get(resp.request_id)
        if fut is not None and not fut.done():
            fut.set_result(resp)
