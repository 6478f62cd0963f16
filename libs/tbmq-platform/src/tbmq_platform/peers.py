"""Which instance of a peer service serves a client: the one rule every caller of app-delivery (the connector)
and device-persistence's Persist streams (the router) pins a client id with."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def pick_target(targets: Sequence[T], client_id: str | bytes) -> T:
    """A client id is pinned to one of `targets` by a stable hash (CRC-32 of its UTF-8 bytes): the same
    instance for as long as the list is the same, so one instance handles the client's requests in order."""
    key = client_id.encode("utf-8") if isinstance(client_id, str) else client_id
    return targets[zlib.crc32(key) % len(targets)]
