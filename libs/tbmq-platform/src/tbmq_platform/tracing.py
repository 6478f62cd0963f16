"""W3C trace context across hops: Kafka record headers and gRPC metadata.

Kafka headers are a list of (str, bytes) pairs; gRPC metadata a sequence of (str, str) pairs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind


def kafka_headers(extra: Iterable[tuple[str, bytes]] = ()) -> list[tuple[str, bytes]]:
    """Headers for a produced record: the current trace context plus `extra`."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    headers = [(k, v.encode("ascii")) for k, v in carrier.items()]
    headers.extend(extra)
    return headers


def context_from_kafka(headers: Sequence[tuple[str, bytes]] | None) -> otel_context.Context:
    carrier = {}
    for key, value in headers or ():
        if key in ("traceparent", "tracestate") and value is not None:
            carrier[key] = value.decode("ascii", "replace")
    return propagate.extract(carrier)


def grpc_metadata(extra: Iterable[tuple[str, str]] = ()) -> list[tuple[str, str]]:
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return [*carrier.items(), *extra]


def context_from_grpc(metadata: Iterable[tuple[str, str | bytes]] | None) -> otel_context.Context:
    carrier = {}
    for key, value in metadata or ():
        if key in ("traceparent", "tracestate"):
            carrier[key] = value if isinstance(value, str) else value.decode("ascii", "replace")
    return propagate.extract(carrier)


def header(headers: Sequence[tuple[str, bytes]] | None, name: str) -> bytes | None:
    for key, value in headers or ():
        if key == name:
            return value
    return None


@contextmanager
def span_from_kafka(tracer: trace.Tracer, name: str, headers, kind: SpanKind = SpanKind.CONSUMER,
                    **attributes) -> Iterator[Span]:
    """A span continuing the trace carried by a consumed record (Faust agents and raw consumers)."""
    ctx = context_from_kafka(headers)
    with tracer.start_as_current_span(name, context=ctx, kind=kind, attributes=attributes or None) as span:
        yield span
