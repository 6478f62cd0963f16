"""Will messages: THE rules the connector (a connection that ends) and the session registry (a connector that
died) both apply. Pure, no I/O.

* When the Will goes out after an ungraceful end: the v5 Will Delay Interval, but no later than the end of
  the session [MQTT-3.1.2-8, MQTT-3.1.3-9] (`will_delay_seconds`); 3.x has no delay.
* What publishing it writes (`publish_records`): the publisher's copy on tbmq.msg.all (key = MQTT topic) and,
  for a retained Will, the retained copy on tbmq.msg.retained, where an empty payload deletes the retained
  message [MQTT-3.3.1-6, MQTT-3.3.1-7].
"""

from __future__ import annotations

MQTT_5 = 5

__all__ = ["publish_records", "will_delay_seconds"]


def will_delay_seconds(protocol_level: int, will_delay: int, session_expiry: int) -> int:
    """When the Will goes out after an ungraceful close: v5 Will Delay, but no later than the end of the
    session [MQTT-3.1.2-8], i.e. `session_expiry` (the registry's interval, or the DISCONNECT's) after the
    close; a session that ends at disconnect (0, a resumed one included) sends it at once."""
    if protocol_level != MQTT_5:
        return 0
    return min(will_delay, session_expiry)


def publish_records(msg, msg_all: str, msg_retained: str) -> list[tuple[str, bytes, bytes | None]]:
    """(topic, key, value) of a PUBLISH or Will (a tbmq.v1 PublishMsg) handed to Kafka: tbmq.msg.all, and the
    retained copy when it is retained (None value: an empty payload deletes the retained message)."""
    key = msg.topic.encode("utf-8")
    value = msg.SerializeToString()
    out = [(msg_all, key, value)]
    if msg.retain:
        out.append((msg_retained, key, value if msg.payload else None))
    return out
