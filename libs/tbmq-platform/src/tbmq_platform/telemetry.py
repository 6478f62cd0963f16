"""OpenTelemetry set-up: a tracer provider named after the service; OTLP/gRPC export when configured."""

from __future__ import annotations

import logging

from opentelemetry import trace
from opentelemetry.propagate import set_global_textmap
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)


def configure_telemetry(service_name: str, instance_id: str, otlp_endpoint: str = "",
                        exporter: SpanExporter | None = None) -> TracerProvider:
    """Install the global tracer provider. `exporter` (tests) wins over `otlp_endpoint`."""
    set_global_textmap(TraceContextTextMapPropagator())
    provider = TracerProvider(resource=Resource.create({
        "service.name": service_name,
        "service.instance.id": instance_id,
    }))
    if exporter is None and otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        exporter = OTLPSpanExporter(endpoint=otlp_endpoint, insecure=otlp_endpoint.startswith("http://")
                                    or "://" not in otlp_endpoint)
        log.info("exporting traces to %s", otlp_endpoint)
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return provider
