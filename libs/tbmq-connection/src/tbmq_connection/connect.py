"""CONNECT validation and the values a connection runs with. Pure (unit-tested).

The session's lifetime is not decided here: the Session Expiry Interval goes to the session registry as the
client asked for it, and the registry's answer carries the capped interval and whether the session is
persistent for this connection (session_registry.logic: the cap and the resume rules of MQTT-3.1.2-4, -5,
-23 have that one home). The connector applies the answer.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from tbmq_mqtt import MQTT_3_1, MQTT_5, Connect, ReasonCode
from tbmq_routing import TopicError, is_reserved_client_id, validate_topic_name

from .limits import topic_problem

CLIENT_ID_NOT_VALID = ReasonCode.CLIENT_IDENTIFIER_NOT_VALID
TOPIC_NAME_INVALID = ReasonCode.TOPIC_NAME_INVALID
MAX_SESSION_EXPIRY = 0xFFFFFFFF
MAX_CLIENT_ID_BYTES = 65535


@dataclass(slots=True)
class ConnectPlan:
    """What a valid CONNECT asks for, after the connector's limits."""

    client_id: str
    assigned_client_id: bool       # the connector made the id up (v5: sent as Assigned Client Identifier)
    keep_alive: int                # seconds the connector enforces (×1.5); 0 = none
    server_keep_alive: int | None  # v5: Server Keep Alive to send in CONNACK (None = not sent)
    requested_session_expiry: int  # v5 Session Expiry Interval as the client sent it (absent: 0; 3.x: 0);
    #                                the registry caps it and says what the session is (its answer)
    clean_start: bool
    receive_maximum: int           # the CLIENT's Receive Maximum (our outbound window), 65535 when absent
    maximum_packet_size: int | None  # the CLIENT's Maximum Packet Size (outbound limit), None = no limit
    topic_alias_maximum: int       # the CLIENT's: outbound topic aliases (flow.OutboundAliases), 0 = none
    will_delay: int                # v5 Will Delay Interval (0 for 3.x or without a will)
    request_problem_information: bool = True   # v5: 0 -> no Reason String outside CONNACK / DISCONNECT
    request_response_information: bool = False  # v5: 1 -> CONNACK may carry Response Information


class ConnectRefused(Exception):
    """The CONNECT is well formed but refused: CONNACK with `reason_code` (v5 code; the codec maps it for
    3.x) and close."""

    def __init__(self, reason_code: int, message: str) -> None:
        super().__init__(message)
        self.reason_code = reason_code
        self.message = message


def new_client_id() -> str:
    return "tbmq-" + uuid.uuid4().hex


def plan_connect(c: Connect, *, server_keep_alive_max: int, max_topic_bytes: int = 65535,
                 max_topic_levels: int = 65535, max_user_properties: int = 65535) -> ConnectPlan:
    """Validate a decoded CONNECT (the codec already checked its syntax) and compute the plan.

    Client identifier rules: any UTF-8 string the codec accepted (1..65535 bytes; MQTT 3.1.1 says a
    server MAY accept more than the 23 [0-9a-zA-Z] characters it MUST accept, and we do). An empty id:
    v5 -> we assign one (Assigned Client Identifier) [MQTT-3.1.3-6] [MQTT-3.1.3-7]; 3.1.1 -> generated
    only with clean session, else identifier rejected (3.1.1 [MQTT-3.1.3-7] [MQTT-3.1.3-8]); 3.1 ->
    identifier rejected (3.1 requires 1..23 characters).
    """
    v5 = c.protocol_level == MQTT_5
    client_id = c.client_id
    assigned = False
    if not client_id:
        if v5 or (c.protocol_level != MQTT_3_1 and c.clean_start):
            client_id = new_client_id()
            assigned = True
        else:
            raise ConnectRefused(CLIENT_ID_NOT_VALID,
                                 "empty client identifier" + ("" if c.protocol_level == MQTT_3_1
                                                              else " without clean session"))
    if is_reserved_client_id(client_id):  # a shared group's store id: no client may take it [MQTT-3.1.3-8]
        raise ConnectRefused(CLIENT_ID_NOT_VALID, "client identifier reserved (a shared subscription's store)")
    if c.will is not None:
        try:
            validate_topic_name(c.will.topic)
        except TopicError as exc:
            raise ConnectRefused(TOPIC_NAME_INVALID, f"will topic: {exc}") from None
        why = topic_problem(c.will.topic, max_topic_bytes, max_topic_levels)
        if why is not None:  # the connector's limits (tbmq_connection.limits)
            raise ConnectRefused(TOPIC_NAME_INVALID, f"will topic {why}")
        if len(c.will.properties.user_properties) > max_user_properties:
            raise ConnectRefused(ReasonCode.QUOTA_EXCEEDED, f"will: more than {max_user_properties} user properties")

    props = c.properties
    keep_alive = c.keep_alive
    server_keep_alive = None
    if v5 and server_keep_alive_max and (keep_alive == 0 or keep_alive > server_keep_alive_max):
        keep_alive = server_keep_alive_max
        server_keep_alive = keep_alive

    requested = (props.session_expiry_interval or 0) if v5 else 0

    will_delay = 0
    if v5 and c.will is not None:
        will_delay = c.will.properties.will_delay_interval or 0

    return ConnectPlan(
        client_id=client_id,
        assigned_client_id=assigned,
        keep_alive=keep_alive,
        server_keep_alive=server_keep_alive,
        requested_session_expiry=requested,
        clean_start=c.clean_start,
        receive_maximum=(props.receive_maximum or 65535) if v5 else 65535,
        maximum_packet_size=props.maximum_packet_size if v5 else None,
        topic_alias_maximum=(props.topic_alias_maximum or 0) if v5 else 0,
        will_delay=will_delay,
        request_problem_information=(props.request_problem_information
                                     if v5 and props.request_problem_information is not None else True),
        request_response_information=bool(v5 and props.request_response_information),
    )
