from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tbmq_platform import tracing


def _tracer():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def test_kafka_headers_carry_the_trace_to_the_consumer_span():
    tracer, exporter = _tracer()
    with tracer.start_as_current_span("produce") as parent:
        headers = tracing.kafka_headers([("x", b"1")])
    assert tracing.header(headers, "traceparent") is not None
    assert tracing.header(headers, "x") == b"1"
    with tracing.span_from_kafka(tracer, "consume", headers):
        pass
    consume = [s for s in exporter.get_finished_spans() if s.name == "consume"][0]
    assert consume.context.trace_id == parent.get_span_context().trace_id
    assert consume.parent.span_id == parent.get_span_context().span_id


def test_grpc_metadata_round_trip():
    tracer, _ = _tracer()
    with tracer.start_as_current_span("call") as span:
        md = tracing.grpc_metadata()
    ctx = tracing.context_from_grpc(md)
    from opentelemetry import trace
    assert trace.get_current_span(ctx).get_span_context().trace_id == span.get_span_context().trace_id


def test_no_trace_no_headers():
    assert tracing.kafka_headers() == []


def test_spans_on_when_exported_or_asked_for():
    from types import SimpleNamespace as S
    assert not tracing.spans_on(S(otlp_endpoint="", trace_spans=False))
    assert tracing.spans_on(S(otlp_endpoint="", trace_spans=True))
    assert tracing.spans_on(S(otlp_endpoint="http://collector:4317", trace_spans=False))
