from tbmq.v1 import messages_pb2 as _messages_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ForwardAckStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FORWARD_ACK_STATUS_APPLIED: _ClassVar[ForwardAckStatus]
    FORWARD_ACK_STATUS_INVALID_ARGUMENT: _ClassVar[ForwardAckStatus]
    FORWARD_ACK_STATUS_UNAVAILABLE: _ClassVar[ForwardAckStatus]
FORWARD_ACK_STATUS_APPLIED: ForwardAckStatus
FORWARD_ACK_STATUS_INVALID_ARGUMENT: ForwardAckStatus
FORWARD_ACK_STATUS_UNAVAILABLE: ForwardAckStatus

class PersistBatch(_message.Message):
    __slots__ = ("seq", "records")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    records: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, seq: _Optional[int] = ..., records: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PersistAnswer(_message.Message):
    __slots__ = ("seq", "saved")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SAVED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    saved: int
    def __init__(self, seq: _Optional[int] = ..., saved: _Optional[int] = ...) -> None: ...

class FetchUndeliveredRequest(_message.Message):
    __slots__ = ("client_id", "service_id", "session_id", "resync", "after_serial", "max_messages", "max_bytes")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SERVICE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    AFTER_SERIAL_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    service_id: str
    session_id: str
    resync: bool
    after_serial: int
    max_messages: int
    max_bytes: int
    def __init__(self, client_id: _Optional[str] = ..., service_id: _Optional[str] = ..., session_id: _Optional[str] = ..., resync: _Optional[bool] = ..., after_serial: _Optional[int] = ..., max_messages: _Optional[int] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class DetachRequest(_message.Message):
    __slots__ = ("client_id", "session_id")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    session_id: str
    def __init__(self, client_id: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class DetachResponse(_message.Message):
    __slots__ = ("detached",)
    DETACHED_FIELD_NUMBER: _ClassVar[int]
    detached: bool
    def __init__(self, detached: _Optional[bool] = ...) -> None: ...

class FetchUndeliveredResponse(_message.Message):
    __slots__ = ("messages", "not_attached", "more")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    NOT_ATTACHED_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[_messages_pb2.DevicePublishMsg]
    not_attached: bool
    more: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[_messages_pb2.DevicePublishMsg, _Mapping]]] = ..., not_attached: _Optional[bool] = ..., more: _Optional[bool] = ...) -> None: ...

class PacketRequest(_message.Message):
    __slots__ = ("client_id", "packet_id", "serial")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    PACKET_ID_FIELD_NUMBER: _ClassVar[int]
    SERIAL_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    packet_id: int
    serial: int
    def __init__(self, client_id: _Optional[str] = ..., packet_id: _Optional[int] = ..., serial: _Optional[int] = ...) -> None: ...

class PacketResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class PacketBatchRequest(_message.Message):
    __slots__ = ("acks", "pubrecs")
    ACKS_FIELD_NUMBER: _ClassVar[int]
    PUBRECS_FIELD_NUMBER: _ClassVar[int]
    acks: _containers.RepeatedCompositeFieldContainer[PacketRequest]
    pubrecs: _containers.RepeatedCompositeFieldContainer[PacketRequest]
    def __init__(self, acks: _Optional[_Iterable[_Union[PacketRequest, _Mapping]]] = ..., pubrecs: _Optional[_Iterable[_Union[PacketRequest, _Mapping]]] = ...) -> None: ...

class PacketBatchResponse(_message.Message):
    __slots__ = ("acknowledged", "marked")
    ACKNOWLEDGED_FIELD_NUMBER: _ClassVar[int]
    MARKED_FIELD_NUMBER: _ClassVar[int]
    acknowledged: int
    marked: int
    def __init__(self, acknowledged: _Optional[int] = ..., marked: _Optional[int] = ...) -> None: ...

class ForwardOpen(_message.Message):
    __slots__ = ("service_id",)
    SERVICE_ID_FIELD_NUMBER: _ClassVar[int]
    service_id: str
    def __init__(self, service_id: _Optional[str] = ...) -> None: ...

class ForwardAcks(_message.Message):
    __slots__ = ("seq", "batch")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    seq: int
    batch: PacketBatchRequest
    def __init__(self, seq: _Optional[int] = ..., batch: _Optional[_Union[PacketBatchRequest, _Mapping]] = ...) -> None: ...

class ForwardSettle(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class ForwardUp(_message.Message):
    __slots__ = ("open", "acks", "settled")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    ACKS_FIELD_NUMBER: _ClassVar[int]
    SETTLED_FIELD_NUMBER: _ClassVar[int]
    open: ForwardOpen
    acks: ForwardAcks
    settled: ForwardSettle
    def __init__(self, open: _Optional[_Union[ForwardOpen, _Mapping]] = ..., acks: _Optional[_Union[ForwardAcks, _Mapping]] = ..., settled: _Optional[_Union[ForwardSettle, _Mapping]] = ...) -> None: ...

class ForwardReady(_message.Message):
    __slots__ = ("instance_id",)
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    def __init__(self, instance_id: _Optional[str] = ...) -> None: ...

class ForwardBatch(_message.Message):
    __slots__ = ("messages", "paused")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[_messages_pb2.DevicePublishMsg]
    paused: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, messages: _Optional[_Iterable[_Union[_messages_pb2.DevicePublishMsg, _Mapping]]] = ..., paused: _Optional[_Iterable[str]] = ...) -> None: ...

class ForwardAcked(_message.Message):
    __slots__ = ("seq", "status", "acknowledged", "marked", "detail")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ACKNOWLEDGED_FIELD_NUMBER: _ClassVar[int]
    MARKED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    seq: int
    status: ForwardAckStatus
    acknowledged: int
    marked: int
    detail: str
    def __init__(self, seq: _Optional[int] = ..., status: _Optional[_Union[ForwardAckStatus, str]] = ..., acknowledged: _Optional[int] = ..., marked: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class ForwardDown(_message.Message):
    __slots__ = ("ready", "batch", "acked", "settle")
    READY_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    ACKED_FIELD_NUMBER: _ClassVar[int]
    SETTLE_FIELD_NUMBER: _ClassVar[int]
    ready: ForwardReady
    batch: ForwardBatch
    acked: ForwardAcked
    settle: ForwardSettle
    def __init__(self, ready: _Optional[_Union[ForwardReady, _Mapping]] = ..., batch: _Optional[_Union[ForwardBatch, _Mapping]] = ..., acked: _Optional[_Union[ForwardAcked, _Mapping]] = ..., settle: _Optional[_Union[ForwardSettle, _Mapping]] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ("client_id",)
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    def __init__(self, client_id: _Optional[str] = ...) -> None: ...

class ClearResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...

class AppSharedSubscription(_message.Message):
    __slots__ = ("share_name", "topic_filter", "qos")
    SHARE_NAME_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    QOS_FIELD_NUMBER: _ClassVar[int]
    share_name: str
    topic_filter: str
    qos: int
    def __init__(self, share_name: _Optional[str] = ..., topic_filter: _Optional[str] = ..., qos: _Optional[int] = ...) -> None: ...

class AppOpen(_message.Message):
    __slots__ = ("client_id", "session_id", "receive_maximum", "shared", "batches")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_MAXIMUM_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    session_id: str
    receive_maximum: int
    shared: _containers.RepeatedCompositeFieldContainer[AppSharedSubscription]
    batches: bool
    def __init__(self, client_id: _Optional[str] = ..., session_id: _Optional[str] = ..., receive_maximum: _Optional[int] = ..., shared: _Optional[_Iterable[_Union[AppSharedSubscription, _Mapping]]] = ..., batches: _Optional[bool] = ...) -> None: ...

class AppRecordRef(_message.Message):
    __slots__ = ("topic", "partition", "offset")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    offset: int
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class AppAck(_message.Message):
    __slots__ = ("ref",)
    REF_FIELD_NUMBER: _ClassVar[int]
    ref: AppRecordRef
    def __init__(self, ref: _Optional[_Union[AppRecordRef, _Mapping]] = ...) -> None: ...

class AppAckBatch(_message.Message):
    __slots__ = ("refs",)
    REFS_FIELD_NUMBER: _ClassVar[int]
    refs: _containers.RepeatedCompositeFieldContainer[AppRecordRef]
    def __init__(self, refs: _Optional[_Iterable[_Union[AppRecordRef, _Mapping]]] = ...) -> None: ...

class AppUpstream(_message.Message):
    __slots__ = ("open", "ack", "acks")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    ACKS_FIELD_NUMBER: _ClassVar[int]
    open: AppOpen
    ack: AppAck
    acks: AppAckBatch
    def __init__(self, open: _Optional[_Union[AppOpen, _Mapping]] = ..., ack: _Optional[_Union[AppAck, _Mapping]] = ..., acks: _Optional[_Union[AppAckBatch, _Mapping]] = ...) -> None: ...

class AppRecord(_message.Message):
    __slots__ = ("ref", "msg", "redelivery")
    REF_FIELD_NUMBER: _ClassVar[int]
    MSG_FIELD_NUMBER: _ClassVar[int]
    REDELIVERY_FIELD_NUMBER: _ClassVar[int]
    ref: AppRecordRef
    msg: _messages_pb2.PublishMsg
    redelivery: bool
    def __init__(self, ref: _Optional[_Union[AppRecordRef, _Mapping]] = ..., msg: _Optional[_Union[_messages_pb2.PublishMsg, _Mapping]] = ..., redelivery: _Optional[bool] = ...) -> None: ...

class AppRecordBatch(_message.Message):
    __slots__ = ("records",)
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[AppRecord]
    def __init__(self, records: _Optional[_Iterable[_Union[AppRecord, _Mapping]]] = ...) -> None: ...

class AppDownstream(_message.Message):
    __slots__ = ("record", "batch")
    RECORD_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    record: AppRecord
    batch: AppRecordBatch
    def __init__(self, record: _Optional[_Union[AppRecord, _Mapping]] = ..., batch: _Optional[_Union[AppRecordBatch, _Mapping]] = ...) -> None: ...
