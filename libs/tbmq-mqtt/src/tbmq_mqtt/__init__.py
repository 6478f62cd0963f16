"""tbmq_mqtt: sans-io MQTT 3.1 / 3.1.1 / 5.0 codec (bytes <-> packet dataclasses, no I/O)."""

from .codec import (
    DEFAULT_MAX_PACKET_SIZE,
    MAX_PACKET_SIZE,
    MqttDecoder,
    Role,
    decode,
    encode,
    server_error_response,
)
from .errors import MqttProtocolError
from .packets import (
    EMPTY_PROPERTIES,
    MQTT_3_1,
    MQTT_3_1_1,
    MQTT_5,
    PROTOCOL_NAMES,
    SUPPORTED_PROTOCOL_LEVELS,
    Auth,
    ConnAck,
    Connect,
    Disconnect,
    Packet,
    PacketType,
    PingReq,
    PingResp,
    Properties,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    Subscription,
    UnsubAck,
    Unsubscribe,
    Will,
)
from .properties import (
    PROPERTY_BY_ID,
    PROPERTY_SPECS,
    PropertyId,
    PropertyType,
    allowed_properties,
    check_response_topic,
)
from .reason_codes import (
    REASON_CODES_BY_PACKET,
    ConnackReturnCode,
    ReasonCode,
    to_v3_connack_return_code,
)

__all__ = [
    "Auth", "ConnAck", "Connect", "ConnackReturnCode", "DEFAULT_MAX_PACKET_SIZE", "Disconnect",
    "EMPTY_PROPERTIES", "MAX_PACKET_SIZE", "MQTT_3_1", "MQTT_3_1_1", "MQTT_5", "MqttDecoder",
    "MqttProtocolError", "PROPERTY_BY_ID", "PROPERTY_SPECS", "PROTOCOL_NAMES", "Packet",
    "PacketType", "PingReq", "PingResp", "Properties", "PropertyId", "PropertyType", "PubAck",
    "PubComp", "PubRec", "PubRel", "Publish", "REASON_CODES_BY_PACKET", "ReasonCode", "Role",
    "SUPPORTED_PROTOCOL_LEVELS", "SubAck", "Subscribe", "Subscription", "UnsubAck",
    "Unsubscribe", "Will", "allowed_properties", "check_response_topic", "decode", "encode",
    "server_error_response",
    "to_v3_connack_return_code",
]
