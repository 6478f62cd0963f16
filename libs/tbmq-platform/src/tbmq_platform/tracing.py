"""W3C trace context across hops: Kafka record headers and gRPC metadata.

Kafka headers are a list of (str, bytes) pairs; gRPC metadata a sequence of (str, str) pairs. The keys that
carry the context (``TRACE_HEADER_KEYS``) and a fresh context without a span (``fresh_trace_headers``) are
defined here only; every service uses them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from random import getrandbits

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind


TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
#: W3C trace context keys, in Kafka headers and gRPC metadata alike.
TRACE_HEADER_KEYS = (TRACEPARENT, TRACESTATE)


def spans_on(settings) -> bool:
    """Whether a service creates its per-message and per-batch spans: only when they are exported
    (`OTEL_EXPORTER_OTLP_ENDPOINT` set) or asked for (the service's `<PREFIX>_TRACE_SPANS`). A span costs more
    than most of the work it would time (docs/performance.md); without one the records still carry a
    `traceparent` (`fresh_trace_headers`). `settings` has `otlp_endpoint` and `trace_spans`."""
    return bool(settings.otlp_endpoint) or bool(settings.trace_spans)


def fresh_trace_headers() -> list[tuple[str, bytes]]:
    """Kafka headers starting a new W3C trace when no span is created (no exporter): the record still
    carries a `traceparent` (random trace and parent ids, sampled) that the next hops continue, for a
    fraction of a span's cost."""
    return [(TRACEPARENT, b"00-%032x-%016x-01" % (getrandbits(128) or 1, getrandbits(64) or 1))]


def trace_headers(headers: Iterable[tuple[str, bytes]] | None) -> list[tuple[str, bytes]]:
    """The trace context headers of a record (to carry them on to the records it causes)."""
    return [(k, v) for k, v in headers or () if k in TRACE_HEADER_KEYS]


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
        if key in TRACE_HEADER_KEYS and value is not None:
            carrier[key] = value.decode("ascii", "replace")
    return propagate.extract(carrier)


def grpc_metadata(extra: Iterable[tuple[str, str]] = ()) -> list[tuple[str, str]]:
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return [*carrier.items(), *extra]


def context_from_grpc(metadata: Iterable[tuple[str, str | bytes]] | None) -> otel_context.Context:
    carrier = {}
    for key, value in metadata or ():
        if key in TRACE_HEADER_KEYS:
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
