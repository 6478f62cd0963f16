"""The fetch answer spliced from fetch_undelivered.lua's reply is exactly protobuf's own encoding."""

from __future__ import annotations

import pytest
from tbmq.v1 import messages_pb2 as pb
from tbmq.v1 import services_pb2 as spb

from tbmq_device_persistence.store import _stored_messages_wire


@pytest.mark.parametrize("client_id", ["", "dev-1", "é-ü-客户", "x" * 300])
def test_spliced_answer_equals_protobuf_encoding(client_id):
    small = pb.PublishMsg(topic="a/b", payload=b"x", qos=1)
    large = pb.PublishMsg(topic="t/" * 100, payload=bytes(range(256)) * 80, qos=2, retain=True,
                          user_properties=[pb.UserProperty(key="k", value="v")], message_expiry_interval=9)
    stored = [  # (packet id, serial, type byte, message, handed out before): varints of 1, 2 and 3+ bytes
        (1, 1, b"P", small, False),
        (127, 128, b"R", large, True),
        (16384, 2**21, b"P", pb.PublishMsg(), True),
        (65535, 2**53, b"R", small, False),
        (300, 7, b"P", large, False),
    ]
    reply = []
    expected = spb.FetchUndeliveredResponse()
    for pid, serial, kind, msg, before in stored:
        # the stored value's packet id bytes are those from before the script: 0 = never handed out
        reply += [pid, serial, kind + (pid if before else 0).to_bytes(2, "big") + msg.SerializeToString()]
        kind_pb = pb.DEVICE_PACKET_TYPE_PUBREL if kind == b"R" else pb.DEVICE_PACKET_TYPE_PUBLISH
        expected.messages.add(client_id=client_id, packet_id=pid, serial=serial, msg=msg, packet_type=kind_pb,
                              redelivery=before)
    cid_field = pb.DevicePublishMsg(client_id=client_id).SerializeToString()
    wire = _stored_messages_wire(cid_field, reply)
    assert wire == expected.SerializeToString()
    assert spb.FetchUndeliveredResponse.FromString(wire) == expected
    assert _stored_messages_wire(cid_field, []) == b""
