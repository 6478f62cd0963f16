"""Protobuf wire-format pieces the services splice by hand instead of building protobuf objects per record
(the router's BasicDownlink, device-persistence's FetchUndeliveredResponse): one home for the encoding."""

from __future__ import annotations

_SMALL = [bytes((n,)) for n in range(128)]


def varint(n: int) -> bytes:
    """The base-128 varint of a non-negative int. Packet ids, serials and lengths are mostly one to three
    bytes: those are built without a loop."""
    if n < 128:
        return _SMALL[n]
    if n < 16384:
        return bytes(((n & 127) | 128, n >> 7))
    if n < 2097152:
        return bytes(((n & 127) | 128, ((n >> 7) & 127) | 128, n >> 14))
    out = bytearray()
    while n >= 128:
        out.append((n & 127) | 128)
        n >>= 7
    out.append(n)
    return bytes(out)


__all__ = ["varint"]
