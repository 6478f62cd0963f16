from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DevicePacketType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEVICE_PACKET_TYPE_PUBLISH: _ClassVar[DevicePacketType]
    DEVICE_PACKET_TYPE_PUBREL: _ClassVar[DevicePacketType]

class ClientType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CLIENT_TYPE_DEVICE: _ClassVar[ClientType]
    CLIENT_TYPE_APPLICATION: _ClassVar[ClientType]

class SessionEventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_EVENT_CONNECTION_REQUEST: _ClassVar[SessionEventType]
    SESSION_EVENT_DISCONNECTION_REQUEST: _ClassVar[SessionEventType]
    SESSION_EVENT_CLEAR_SESSION_REQUEST: _ClassVar[SessionEventType]
    SESSION_EVENT_REMOVE_APPLICATION_TOPIC_REQUEST: _ClassVar[SessionEventType]
    SESSION_EVENT_CONNECTOR_GONE_REQUEST: _ClassVar[SessionEventType]
    SESSION_EVENT_WILL_DUE_REQUEST: _ClassVar[SessionEventType]
    SESSION_EVENT_TAKEN_OVER_WILL_REQUEST: _ClassVar[SessionEventType]

class SessionFailure(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_FAILURE_NONE: _ClassVar[SessionFailure]
    SESSION_FAILURE_UNSPECIFIED_ERROR: _ClassVar[SessionFailure]
    SESSION_FAILURE_QUOTA_EXCEEDED: _ClassVar[SessionFailure]
    SESSION_FAILURE_SERVER_UNAVAILABLE: _ClassVar[SessionFailure]
    SESSION_FAILURE_CLIENT_ID_NOT_VALID: _ClassVar[SessionFailure]
    SESSION_FAILURE_CONNECTOR_FENCED: _ClassVar[SessionFailure]

class DisconnectReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DISCONNECT_REASON_SESSION_TAKEN_OVER: _ClassVar[DisconnectReason]
    DISCONNECT_REASON_ADMINISTRATIVE: _ClassVar[DisconnectReason]
    DISCONNECT_REASON_SERVER_SHUTTING_DOWN: _ClassVar[DisconnectReason]
    DISCONNECT_REASON_CONNECTOR_FENCED: _ClassVar[DisconnectReason]

class RetainHandling(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RETAIN_HANDLING_SEND: _ClassVar[RetainHandling]
    RETAIN_HANDLING_SEND_IF_NOT_EXISTS: _ClassVar[RetainHandling]
    RETAIN_HANDLING_DONT_SEND: _ClassVar[RetainHandling]
DEVICE_PACKET_TYPE_PUBLISH: DevicePacketType
DEVICE_PACKET_TYPE_PUBREL: DevicePacketType
CLIENT_TYPE_DEVICE: ClientType
CLIENT_TYPE_APPLICATION: ClientType
SESSION_EVENT_CONNECTION_REQUEST: SessionEventType
SESSION_EVENT_DISCONNECTION_REQUEST: SessionEventType
SESSION_EVENT_CLEAR_SESSION_REQUEST: SessionEventType
SESSION_EVENT_REMOVE_APPLICATION_TOPIC_REQUEST: SessionEventType
SESSION_EVENT_CONNECTOR_GONE_REQUEST: SessionEventType
SESSION_EVENT_WILL_DUE_REQUEST: SessionEventType
SESSION_EVENT_TAKEN_OVER_WILL_REQUEST: SessionEventType
SESSION_FAILURE_NONE: SessionFailure
SESSION_FAILURE_UNSPECIFIED_ERROR: SessionFailure
SESSION_FAILURE_QUOTA_EXCEEDED: SessionFailure
SESSION_FAILURE_SERVER_UNAVAILABLE: SessionFailure
SESSION_FAILURE_CLIENT_ID_NOT_VALID: SessionFailure
SESSION_FAILURE_CONNECTOR_FENCED: SessionFailure
DISCONNECT_REASON_SESSION_TAKEN_OVER: DisconnectReason
DISCONNECT_REASON_ADMINISTRATIVE: DisconnectReason
DISCONNECT_REASON_SERVER_SHUTTING_DOWN: DisconnectReason
DISCONNECT_REASON_CONNECTOR_FENCED: DisconnectReason
RETAIN_HANDLING_SEND: RetainHandling
RETAIN_HANDLING_SEND_IF_NOT_EXISTS: RetainHandling
RETAIN_HANDLING_DONT_SEND: RetainHandling

class UserProperty(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class PublishMsg(_message.Message):
    __slots__ = ("publisher_id", "topic", "payload", "qos", "retain", "user_properties", "payload_format_indicator", "content_type", "response_topic", "correlation_data", "message_expiry_interval", "subscription_ids", "created_at_ms", "publisher_mqtt_version", "publisher_service_id", "origin_partition", "origin_offset")
    PUBLISHER_ID_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    QOS_FIELD_NUMBER: _ClassVar[int]
    RETAIN_FIELD_NUMBER: _ClassVar[int]
    USER_PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FORMAT_INDICATOR_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TOPIC_FIELD_NUMBER: _ClassVar[int]
    CORRELATION_DATA_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_EXPIRY_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_IDS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHER_MQTT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PUBLISHER_SERVICE_ID_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_PARTITION_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_OFFSET_FIELD_NUMBER: _ClassVar[int]
    publisher_id: str
    topic: str
    payload: bytes
    qos: int
    retain: bool
    user_properties: _containers.RepeatedCompositeFieldContainer[UserProperty]
    payload_format_indicator: int
    content_type: str
    response_topic: str
    correlation_data: bytes
    message_expiry_interval: int
    subscription_ids: _containers.RepeatedScalarFieldContainer[int]
    created_at_ms: int
    publisher_mqtt_version: int
    publisher_service_id: str
    origin_partition: int
    origin_offset: int
    def __init__(self, publisher_id: _Optional[str] = ..., topic: _Optional[str] = ..., payload: _Optional[bytes] = ..., qos: _Optional[int] = ..., retain: _Optional[bool] = ..., user_properties: _Optional[_Iterable[_Union[UserProperty, _Mapping]]] = ..., payload_format_indicator: _Optional[int] = ..., content_type: _Optional[str] = ..., response_topic: _Optional[str] = ..., correlation_data: _Optional[bytes] = ..., message_expiry_interval: _Optional[int] = ..., subscription_ids: _Optional[_Iterable[int]] = ..., created_at_ms: _Optional[int] = ..., publisher_mqtt_version: _Optional[int] = ..., publisher_service_id: _Optional[str] = ..., origin_partition: _Optional[int] = ..., origin_offset: _Optional[int] = ...) -> None: ...

class Recipient(_message.Message):
    __slots__ = ("client_id", "qos", "retain", "subscription_ids")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    QOS_FIELD_NUMBER: _ClassVar[int]
    RETAIN_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_IDS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    qos: int
    retain: bool
    subscription_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, client_id: _Optional[str] = ..., qos: _Optional[int] = ..., retain: _Optional[bool] = ..., subscription_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BasicDownlink(_message.Message):
    __slots__ = ("msg", "recipients", "origin_partition", "origin_offset")
    MSG_FIELD_NUMBER: _ClassVar[int]
    RECIPIENTS_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_PARTITION_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_OFFSET_FIELD_NUMBER: _ClassVar[int]
    msg: PublishMsg
    recipients: _containers.RepeatedCompositeFieldContainer[Recipient]
    origin_partition: int
    origin_offset: int
    def __init__(self, msg: _Optional[_Union[PublishMsg, _Mapping]] = ..., recipients: _Optional[_Iterable[_Union[Recipient, _Mapping]]] = ..., origin_partition: _Optional[int] = ..., origin_offset: _Optional[int] = ...) -> None: ...

class PersistedMsg(_message.Message):
    __slots__ = ("client_id", "msg", "origin_partition", "origin_offset")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    MSG_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_PARTITION_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_OFFSET_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    msg: PublishMsg
    origin_partition: int
    origin_offset: int
    def __init__(self, client_id: _Optional[str] = ..., msg: _Optional[_Union[PublishMsg, _Mapping]] = ..., origin_partition: _Optional[int] = ..., origin_offset: _Optional[int] = ...) -> None: ...

class DevicePublishMsg(_message.Message):
    __slots__ = ("client_id", "packet_id", "serial", "packet_type", "msg", "redelivery")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    PACKET_ID_FIELD_NUMBER: _ClassVar[int]
    SERIAL_FIELD_NUMBER: _ClassVar[int]
    PACKET_TYPE_FIELD_NUMBER: _ClassVar[int]
    MSG_FIELD_NUMBER: _ClassVar[int]
    REDELIVERY_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    packet_id: int
    serial: int
    packet_type: DevicePacketType
    msg: PublishMsg
    redelivery: bool
    def __init__(self, client_id: _Optional[str] = ..., packet_id: _Optional[int] = ..., serial: _Optional[int] = ..., packet_type: _Optional[_Union[DevicePacketType, str]] = ..., msg: _Optional[_Union[PublishMsg, _Mapping]] = ..., redelivery: _Optional[bool] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("client_id", "service_id", "session_id", "client_type", "connected", "clean_start", "persistent", "session_expiry_interval", "mqtt_version", "keep_alive", "connected_at_ms", "disconnected_at_ms", "client_address", "username", "last_request_id", "awaiting_pubrel", "connector_incarnation", "will", "will_delay", "taken_over_will", "clear_at_end")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SERVICE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    CLEAN_START_FIELD_NUMBER: _ClassVar[int]
    PERSISTENT_FIELD_NUMBER: _ClassVar[int]
    SESSION_EXPIRY_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    MQTT_VERSION_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    DISCONNECTED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    USERNAME_FIELD_NUMBER: _ClassVar[int]
    LAST_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    AWAITING_PUBREL_FIELD_NUMBER: _ClassVar[int]
    CONNECTOR_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    WILL_FIELD_NUMBER: _ClassVar[int]
    WILL_DELAY_FIELD_NUMBER: _ClassVar[int]
    TAKEN_OVER_WILL_FIELD_NUMBER: _ClassVar[int]
    CLEAR_AT_END_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    service_id: str
    session_id: str
    client_type: ClientType
    connected: bool
    clean_start: bool
    persistent: bool
    session_expiry_interval: int
    mqtt_version: int
    keep_alive: int
    connected_at_ms: int
    disconnected_at_ms: int
    client_address: str
    username: str
    last_request_id: str
    awaiting_pubrel: _containers.RepeatedScalarFieldContainer[int]
    connector_incarnation: str
    will: PublishMsg
    will_delay: int
    taken_over_will: TakenOverWill
    clear_at_end: bool
    def __init__(self, client_id: _Optional[str] = ..., service_id: _Optional[str] = ..., session_id: _Optional[str] = ..., client_type: _Optional[_Union[ClientType, str]] = ..., connected: _Optional[bool] = ..., clean_start: _Optional[bool] = ..., persistent: _Optional[bool] = ..., session_expiry_interval: _Optional[int] = ..., mqtt_version: _Optional[int] = ..., keep_alive: _Optional[int] = ..., connected_at_ms: _Optional[int] = ..., disconnected_at_ms: _Optional[int] = ..., client_address: _Optional[str] = ..., username: _Optional[str] = ..., last_request_id: _Optional[str] = ..., awaiting_pubrel: _Optional[_Iterable[int]] = ..., connector_incarnation: _Optional[str] = ..., will: _Optional[_Union[PublishMsg, _Mapping]] = ..., will_delay: _Optional[int] = ..., taken_over_will: _Optional[_Union[TakenOverWill, _Mapping]] = ..., clear_at_end: _Optional[bool] = ...) -> None: ...

class TakenOverWill(_message.Message):
    __slots__ = ("will", "service_id", "connector_incarnation", "taken_over_at_ms")
    WILL_FIELD_NUMBER: _ClassVar[int]
    SERVICE_ID_FIELD_NUMBER: _ClassVar[int]
    CONNECTOR_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    TAKEN_OVER_AT_MS_FIELD_NUMBER: _ClassVar[int]
    will: PublishMsg
    service_id: str
    connector_incarnation: str
    taken_over_at_ms: int
    def __init__(self, will: _Optional[_Union[PublishMsg, _Mapping]] = ..., service_id: _Optional[str] = ..., connector_incarnation: _Optional[str] = ..., taken_over_at_ms: _Optional[int] = ...) -> None: ...

class SessionEventRequest(_message.Message):
    __slots__ = ("request_id", "type", "session", "request_time_ms", "disconnect_session_expiry_interval", "force_cleanup", "graceful", "awaiting_pubrel", "publish_will")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    DISCONNECT_SESSION_EXPIRY_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    FORCE_CLEANUP_FIELD_NUMBER: _ClassVar[int]
    GRACEFUL_FIELD_NUMBER: _ClassVar[int]
    AWAITING_PUBREL_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_WILL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    type: SessionEventType
    session: SessionInfo
    request_time_ms: int
    disconnect_session_expiry_interval: int
    force_cleanup: bool
    graceful: bool
    awaiting_pubrel: _containers.RepeatedScalarFieldContainer[int]
    publish_will: bool
    def __init__(self, request_id: _Optional[str] = ..., type: _Optional[_Union[SessionEventType, str]] = ..., session: _Optional[_Union[SessionInfo, _Mapping]] = ..., request_time_ms: _Optional[int] = ..., disconnect_session_expiry_interval: _Optional[int] = ..., force_cleanup: _Optional[bool] = ..., graceful: _Optional[bool] = ..., awaiting_pubrel: _Optional[_Iterable[int]] = ..., publish_will: _Optional[bool] = ...) -> None: ...

class SessionEventResponse(_message.Message):
    __slots__ = ("request_id", "client_id", "success", "session_present", "failure", "client_type", "session_expiry_interval", "persistent", "awaiting_pubrel", "mark_routing")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    SESSION_PRESENT_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    SESSION_EXPIRY_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    PERSISTENT_FIELD_NUMBER: _ClassVar[int]
    AWAITING_PUBREL_FIELD_NUMBER: _ClassVar[int]
    MARK_ROUTING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    client_id: str
    success: bool
    session_present: bool
    failure: SessionFailure
    client_type: ClientType
    session_expiry_interval: int
    persistent: bool
    awaiting_pubrel: _containers.RepeatedScalarFieldContainer[int]
    mark_routing: bool
    def __init__(self, request_id: _Optional[str] = ..., client_id: _Optional[str] = ..., success: _Optional[bool] = ..., session_present: _Optional[bool] = ..., failure: _Optional[_Union[SessionFailure, str]] = ..., client_type: _Optional[_Union[ClientType, str]] = ..., session_expiry_interval: _Optional[int] = ..., persistent: _Optional[bool] = ..., awaiting_pubrel: _Optional[_Iterable[int]] = ..., mark_routing: _Optional[bool] = ...) -> None: ...

class ConnectorHeartbeat(_message.Message):
    __slots__ = ("service_id", "incarnation", "sent_at_ms", "stopped", "stats")
    SERVICE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_MS_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    service_id: str
    incarnation: str
    sent_at_ms: int
    stopped: bool
    stats: ConnectorStats
    def __init__(self, service_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., sent_at_ms: _Optional[int] = ..., stopped: _Optional[bool] = ..., stats: _Optional[_Union[ConnectorStats, _Mapping]] = ...) -> None: ...

class ConnectorStats(_message.Message):
    __slots__ = ("clients_connected", "messages_received", "messages_sent", "messages_dropped", "connections", "started_at_ms")
    CLIENTS_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_SENT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    clients_connected: int
    messages_received: int
    messages_sent: int
    messages_dropped: int
    connections: int
    started_at_ms: int
    def __init__(self, clients_connected: _Optional[int] = ..., messages_received: _Optional[int] = ..., messages_sent: _Optional[int] = ..., messages_dropped: _Optional[int] = ..., connections: _Optional[int] = ..., started_at_ms: _Optional[int] = ...) -> None: ...

class DisconnectCommand(_message.Message):
    __slots__ = ("client_id", "session_id", "new_session_clean_start", "reason", "connector_incarnation")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_SESSION_CLEAN_START_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CONNECTOR_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    session_id: str
    new_session_clean_start: bool
    reason: DisconnectReason
    connector_incarnation: str
    def __init__(self, client_id: _Optional[str] = ..., session_id: _Optional[str] = ..., new_session_clean_start: _Optional[bool] = ..., reason: _Optional[_Union[DisconnectReason, str]] = ..., connector_incarnation: _Optional[str] = ...) -> None: ...

class TopicSubscription(_message.Message):
    __slots__ = ("topic_filter", "qos", "share_name", "no_local", "retain_as_published", "retain_handling", "subscription_id")
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    QOS_FIELD_NUMBER: _ClassVar[int]
    SHARE_NAME_FIELD_NUMBER: _ClassVar[int]
    NO_LOCAL_FIELD_NUMBER: _ClassVar[int]
    RETAIN_AS_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    RETAIN_HANDLING_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_ID_FIELD_NUMBER: _ClassVar[int]
    topic_filter: str
    qos: int
    share_name: str
    no_local: bool
    retain_as_published: bool
    retain_handling: RetainHandling
    subscription_id: int
    def __init__(self, topic_filter: _Optional[str] = ..., qos: _Optional[int] = ..., share_name: _Optional[str] = ..., no_local: _Optional[bool] = ..., retain_as_published: _Optional[bool] = ..., retain_handling: _Optional[_Union[RetainHandling, str]] = ..., subscription_id: _Optional[int] = ...) -> None: ...

class ClientSubscriptions(_message.Message):
    __slots__ = ("client_id", "subscriptions", "client_type")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTIONS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    subscriptions: _containers.RepeatedCompositeFieldContainer[TopicSubscription]
    client_type: ClientType
    def __init__(self, client_id: _Optional[str] = ..., subscriptions: _Optional[_Iterable[_Union[TopicSubscription, _Mapping]]] = ..., client_type: _Optional[_Union[ClientType, str]] = ...) -> None: ...

class ApplicationRemovedEvent(_message.Message):
    __slots__ = ("client_id", "topic", "removed_at_ms")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    REMOVED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    topic: str
    removed_at_ms: int
    def __init__(self, client_id: _Optional[str] = ..., topic: _Optional[str] = ..., removed_at_ms: _Optional[int] = ...) -> None: ...

class PersistTally(_message.Message):
    __slots__ = ("second_ms", "copies", "payload_bytes", "copies_by_qos")
    SECOND_MS_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    COPIES_BY_QOS_FIELD_NUMBER: _ClassVar[int]
    second_ms: int
    copies: int
    payload_bytes: int
    copies_by_qos: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, second_ms: _Optional[int] = ..., copies: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., copies_by_qos: _Optional[_Iterable[int]] = ...) -> None: ...

class UsageStat(_message.Message):
    __slots__ = ("key", "dimension", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DIMENSION_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    dimension: str
    value: int
    def __init__(self, key: _Optional[str] = ..., dimension: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...

class UsageStats(_message.Message):
    __slots__ = ("source", "window_start_ms", "window_end_ms", "stats")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_START_MS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_END_MS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    source: str
    window_start_ms: int
    window_end_ms: int
    stats: _containers.RepeatedCompositeFieldContainer[UsageStat]
    def __init__(self, source: _Optional[str] = ..., window_start_ms: _Optional[int] = ..., window_end_ms: _Optional[int] = ..., stats: _Optional[_Iterable[_Union[UsageStat, _Mapping]]] = ...) -> None: ...
