"""Hypothesis property tests of the codec: round trip, truncation, chunking, garbage."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mqtt_codec_samples import LEVELS, PACKETS_BY_LEVEL, any_level_packet, sample_packets

from tbmq_mqtt import Connect, MqttDecoder, MqttProtocolError, Role, encode

pytestmark = pytest.mark.unit

# MQTT_CODEC_EXAMPLES=5000 for a longer fuzzing run
SETTINGS = settings(
    max_examples=int(os.environ.get("MQTT_CODEC_EXAMPLES", "200")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def new_decoder(level: int) -> MqttDecoder:
    return MqttDecoder(level, role=Role.ANY)


@SETTINGS
@given(any_level_packet)
def test_round_trip(level_packet):
    level, pkt = level_packet
    data = encode(pkt, level)
    out = new_decoder(level).feed(data)
    assert out == [pkt]
    assert encode(out[0], level) == data


@SETTINGS
@given(any_level_packet)
def test_every_truncated_prefix_waits_for_more(level_packet):
    level, pkt = level_packet
    data = encode(pkt, level)
    for k in range(len(data)):
        dec = new_decoder(level)
        assert dec.feed(data[:k]) == []
        assert dec.buffered == k
    # a server-side decoder waits too on a truncated CONNECT
    if isinstance(pkt, Connect):
        for k in range(len(data)):
            assert MqttDecoder().feed(data[:k]) == []


@st.composite
def stream_and_cuts(draw):
    level = draw(st.sampled_from(LEVELS))
    pkts = draw(st.lists(PACKETS_BY_LEVEL[level], min_size=1, max_size=6))
    stream = b"".join(encode(p, level) for p in pkts)
    cuts = sorted(draw(st.lists(st.integers(0, len(stream)), max_size=12)))
    return level, pkts, stream, cuts


@SETTINGS
@given(stream_and_cuts())
def test_random_chunking_yields_the_same_packets(arg):
    level, pkts, stream, cuts = arg
    dec = new_decoder(level)
    got = []
    prev = 0
    for c in cuts + [len(stream)]:
        got += dec.feed(stream[prev:c])
        prev = c
    assert got == pkts
    assert dec.buffered == 0


def _feed_garbage(dec: MqttDecoder, chunks) -> None:
    try:
        for c in chunks:
            dec.feed(c)
    except MqttProtocolError as e:
        assert 0x80 <= e.reason_code <= 0xA2
        assert isinstance(e.message, str)


@SETTINGS
@given(st.lists(st.binary(max_size=64), max_size=5), st.sampled_from([None, 3, 4, 5]),
       st.sampled_from(list(Role)))
def test_garbage_only_raises_protocol_errors(chunks, level, role):
    if role is Role.CLIENT and level is None:
        level = 5
    _feed_garbage(MqttDecoder(level, max_packet_size=4096, role=role), chunks)


_MUTABLE = [(lvl, p) for lvl in LEVELS for p in sample_packets(lvl)]


@SETTINGS
@given(st.sampled_from(_MUTABLE), st.data())
def test_mutated_valid_packets_only_raise_protocol_errors(level_packet, data):
    """Flip, insert and delete bytes of valid encodings to reach deep into the decoders."""
    level, pkt = level_packet
    raw = bytearray(encode(pkt, level))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "insert", "delete"]))
        i = data.draw(st.integers(0, max(0, len(raw) - 1)))
        if op == "flip" and raw:
            raw[i] = data.draw(st.integers(0, 255))
        elif op == "insert":
            raw.insert(i, data.draw(st.integers(0, 255)))
        elif raw:
            del raw[i]
    _feed_garbage(MqttDecoder(level, role=Role.ANY), [bytes(raw)])
    # the same bytes after a valid CONNECT through a server-side decoder
    connect = encode(Connect(level, "c"), level)
    _feed_garbage(MqttDecoder(), [connect, bytes(raw)])
