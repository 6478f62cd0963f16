"""MQTT topic name / topic filter validation and shared-subscription parsing.

Pure functions, no I/O. Statement ids in comments refer to the MQTT 5.0 specification
(OASIS, 7 March 2019); the same rules hold for MQTT 3.1.1 except shared subscriptions (3.1.1 numbers
the wildcard rules differently: its [MQTT-4.7.1-1], -2, -3 are 5.0's [MQTT-4.7.0-1], [MQTT-4.7.1-1], -2).

Errors form a small hierarchy so callers can map them to reason codes:

* ``TopicError`` (a ``ValueError``)
  * ``InvalidTopicName``     -> PUBLISH / Will topic: v5 reason 0x90 "Topic Name invalid"
  * ``InvalidTopicFilter``   -> SUBSCRIBE / UNSUBSCRIBE: v5 reason 0x8F "Topic Filter invalid"
    * ``InvalidSharedSubscription`` -> malformed ``$share/...`` (also 0x8F), or a shared
      subscription with No Local set (protocol error, 0x82) -- see ``.protocol_error``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "MAX_TOPIC_BYTES",
    "SHARE_PREFIX",
    "TopicError",
    "InvalidTopicName",
    "InvalidTopicFilter",
    "InvalidSharedSubscription",
    "ParsedFilter",
    "validate_topic_name",
    "validate_topic_filter",
    "is_valid_topic_name",
    "is_valid_topic_filter",
    "parse_subscription_filter",
    "has_wildcard",
    "topic_matches",
    "subscribed_to",
]

#: [MQTT-4.7.3-3] topic names and filters are UTF-8 strings of at most 65,535 bytes.
MAX_TOPIC_BYTES = 65535
#: [MQTT-4.8.2-1] a shared subscription's filter starts with ``$share/``.
SHARE_PREFIX = "$share/"


class TopicError(ValueError):
    """Base class: a topic name or topic filter violates the MQTT rules."""

    def __init__(self, value: str, reason: str, statement: str = "") -> None:
        self.value = value
        self.reason = reason
        #: the MQTT statement id that was violated, e.g. ``"MQTT-4.7.1-2"`` ('' if none)
        self.statement = statement
        shown = value if len(value) <= 80 else value[:77] + "..."
        suffix = f" [{statement}]" if statement else ""
        super().__init__(f"{reason}: {shown!r}{suffix}")


class InvalidTopicName(TopicError):
    """A topic name (PUBLISH, Will) is invalid."""


class InvalidTopicFilter(TopicError):
    """A topic filter (SUBSCRIBE, UNSUBSCRIBE) is invalid."""


class InvalidSharedSubscription(InvalidTopicFilter):
    """A ``$share/<ShareName>/<filter>`` subscription is invalid.

    ``protocol_error`` is True when the problem is a protocol error rather than a bad filter
    (No Local on a shared subscription, [MQTT-3.8.3-4]): the server then closes the connection.
    """

    def __init__(self, value: str, reason: str, statement: str = "", protocol_error: bool = False) -> None:
        super().__init__(value, reason, statement)
        self.protocol_error = protocol_error


@dataclass(frozen=True, slots=True)
class ParsedFilter:
    """A SUBSCRIBE topic filter split into its share name ('' = not shared) and the filter.

    For ``$share/g1/a/+`` this is ``ParsedFilter(share_name='g1', filter='a/+')``; the trie
    stores the subscription under ``filter`` with ``share_name`` set.
    """

    share_name: str
    filter: str

    @property
    def shared(self) -> bool:
        return self.share_name != ""

    def original(self) -> str:
        """The filter as the client sent it (``$share/<name>/<filter>`` when shared)."""
        if self.share_name:
            return f"{SHARE_PREFIX}{self.share_name}/{self.filter}"
        return self.filter


def _check_common(value: str, error: type[TopicError]) -> None:
    # [MQTT-4.7.3-1] at least one character long.
    if not value:
        raise error(value, "must be at least one character long", "MQTT-4.7.3-1")
    # [MQTT-4.7.3-2] no null character U+0000.
    if "\x00" in value:
        raise error(value, "must not contain U+0000", "MQTT-4.7.3-2")
    # [MQTT-1.5.4-1] no surrogate code points; [MQTT-4.7.3-3] at most 65,535 bytes of UTF-8.
    # Cheap bound first: every code point is 1..4 UTF-8 bytes.
    if len(value) > MAX_TOPIC_BYTES // 4 or not value.isascii():
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError:
            raise error(value, "must not contain surrogate code points U+D800..U+DFFF", "MQTT-1.5.4-1") from None
        if size > MAX_TOPIC_BYTES:
            raise error(value, f"encodes to {size} bytes, more than {MAX_TOPIC_BYTES}", "MQTT-4.7.3-3")


def validate_topic_name(topic: str) -> None:
    """Raise ``InvalidTopicName`` unless ``topic`` may be used in PUBLISH (or as a Will topic).

    Empty levels (``a//b``, ``/a``, ``a/``) are valid and distinct; ``$``-topics are valid.
    """
    _check_common(topic, InvalidTopicName)
    # [MQTT-3.3.2-2] / [MQTT-4.7.0-1] wildcard characters must not be used within a topic name.
    if "+" in topic or "#" in topic:
        raise InvalidTopicName(topic, "wildcards '+' and '#' are not allowed in a topic name", "MQTT-3.3.2-2")


def validate_topic_filter(topic_filter: str) -> None:
    """Raise ``InvalidTopicFilter`` unless ``topic_filter`` is a valid (non-shared) topic filter.

    Does not know about ``$share/``: use ``parse_subscription_filter`` for SUBSCRIBE input.
    """
    _check_common(topic_filter, InvalidTopicFilter)
    if "+" not in topic_filter and "#" not in topic_filter:
        return
    levels = topic_filter.split("/")
    last = len(levels) - 1
    for i, level in enumerate(levels):
        if level == "+" or level == "":
            continue
        if level == "#":
            # [MQTT-4.7.1-1] '#' on its own or after '/', and it must be the last character.
            if i != last:
                raise InvalidTopicFilter(topic_filter, "'#' must be the last level", "MQTT-4.7.1-1")
            continue
        if "#" in level:
            raise InvalidTopicFilter(topic_filter, "'#' must occupy a whole level", "MQTT-4.7.1-1")
        if "+" in level:
            # [MQTT-4.7.1-2] '+' must occupy an entire level of the filter.
            raise InvalidTopicFilter(topic_filter, "'+' must occupy a whole level", "MQTT-4.7.1-2")


def is_valid_topic_name(topic: str) -> bool:
    try:
        validate_topic_name(topic)
    except TopicError:
        return False
    return True


def is_valid_topic_filter(topic_filter: str) -> bool:
    try:
        validate_topic_filter(topic_filter)
    except TopicError:
        return False
    return True


def has_wildcard(topic_filter: str) -> bool:
    """True if a (valid) filter contains a '+' or '#' level."""
    return "+" in topic_filter or "#" in topic_filter


def topic_matches(topic_filter: str, topic: str) -> bool:
    """Whether a (valid) topic filter matches a topic name (MQTT 5.0 §4.7): '+' one level, '#' this level's
    parent and everything below it (§4.7.1.2); a filter starting with a wildcard does not match a
    topic starting with '$' [MQTT-4.7.2-1]. The same rule as ``SubscriptionTrie.match``, for one filter.

    `topic` may be a filter too: then the answer is whether `topic_filter` covers it (``filter_covers``): a
    '+' or '#' level of `topic` is matched only by a wildcard ('#' only by '#')."""
    if topic_filter == topic:
        return True
    if "+" not in topic_filter and "#" not in topic_filter:
        return False
    if topic[:1] == "$" and topic_filter[:1] in ("+", "#"):
        return False
    levels = topic.split("/")
    n = len(levels)
    for i, f in enumerate(topic_filter.split("/")):
        if f == "#":
            return True  # also matches the parent level: 'a/#' matches 'a' (§4.7.1.2)
        if i >= n:
            return False
        level = levels[i]
        if (f != "+" and f != level) or level == "#":
            return False
    return i + 1 == n


def filter_covers(pattern: str, topic_filter: str) -> bool:
    """Whether every topic name that (valid) ``topic_filter`` can match is matched by (valid) ``pattern``
    (authorization of a SUBSCRIBE, tbmq_auth): ``topic_matches`` with a filter for the topic. `$SYS/#` needs
    a pattern of its own: one starting with a wildcard does not cover a filter starting with '$'."""
    return topic_matches(pattern, topic_filter)


def subscribed_to(filters, topic: str) -> bool:
    """Whether any of a client's subscriptions (``(share name, filter)`` keys, as the connector holds
    them) matches ``topic``. An exact (no wildcard) subscription is found in O(1)."""
    if ("", topic) in filters:
        return True
    for _share, topic_filter in filters:
        if topic_matches(topic_filter, topic):
            return True
    return False


def parse_subscription_filter(raw: str, *, no_local: bool = False, allow_shared: bool = True) -> ParsedFilter:
    """Validate a SUBSCRIBE/UNSUBSCRIBE filter and split off ``$share/<ShareName>/``.

    ``no_local``: the subscription's No Local option, checked against [MQTT-3.8.3-4].
    ``allow_shared``: False for MQTT 3.x clients, for which ``$share/...`` is an ordinary filter.
    Raises ``InvalidSharedSubscription`` for a malformed shared subscription and
    ``InvalidTopicFilter`` for an invalid filter.
    """
    if not (allow_shared and raw.startswith(SHARE_PREFIX)):
        validate_topic_filter(raw)
        return ParsedFilter("", raw)
    _check_common(raw, InvalidSharedSubscription)
    rest = raw[len(SHARE_PREFIX):]
    slash = rest.find("/")
    share_name = rest if slash < 0 else rest[:slash]
    # [MQTT-4.8.2-1] the ShareName is at least one character long.
    if not share_name:
        raise InvalidSharedSubscription(raw, "ShareName must be at least one character long", "MQTT-4.8.2-1")
    # [MQTT-4.8.2-2] the ShareName must not contain '/', '+' or '#' ...
    if "+" in share_name or "#" in share_name:
        raise InvalidSharedSubscription(raw, "ShareName must not contain '+' or '#'", "MQTT-4.8.2-2")
    # ... and must be followed by '/' and then a topic filter [MQTT-4.8.2-2].
    if slash < 0 or slash == len(rest) - 1:
        raise InvalidSharedSubscription(raw, "ShareName must be followed by '/' and a topic filter", "MQTT-4.8.2-2")
    topic_filter = rest[slash + 1:]
    try:
        validate_topic_filter(topic_filter)
    except InvalidTopicFilter as exc:
        raise InvalidSharedSubscription(
            raw, f"invalid filter in shared subscription ({exc.reason})", exc.statement) from None
    # [MQTT-3.8.3-4] It is a Protocol Error to set No Local on a shared subscription.
    if no_local:
        raise InvalidSharedSubscription(raw, "No Local must not be set on a shared subscription", "MQTT-3.8.3-4",
                                        protocol_error=True)
    return ParsedFilter(share_name, topic_filter)
