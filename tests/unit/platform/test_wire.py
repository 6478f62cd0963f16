"""tbmq_platform.wire against protobuf's own encoder (a differential test)."""

from tbmq.v1 import messages_pb2 as pb
from tbmq_platform.wire import varint


def test_varint_is_protobufs_encoding():
    values = [*range(1, 300), 16383, 16384, 16385, 65535, 2097151, 2097152, 2097153, 2**28 - 1, 2**28,
              2**35 + 17, 2**63 - 1]
    for n in values:
        # DevicePublishMsg.serial is field 3, varint: the tag byte, then the value's varint (0 is not written)
        assert varint(n) == pb.DevicePublishMsg(serial=n).SerializeToString()[1:], n
    assert varint(0) == b"\x00"
