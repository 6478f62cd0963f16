"""Prometheus metrics of a service: `GET /metrics` on its health port (text exposition format 0.0.4), built on
prometheus-client.

Guarantee: the message path pays nothing for them. Services count in plain dicts and ints as they always did
(the same counters /readyz shows); a `Metrics` object reads them only when Prometheus scrapes, through the
sources a service registers (`counter`, `gauge`, and `lag` for Kafka consumers). Latency histograms
(`histogram`) are observed per Redis or gRPC call — one call carries a batch — never per message. The
process's own CPU, memory and file descriptors come from prometheus-client's process collector.

Every metric is named `tbmq_<name>`; series carry the labels a source gives them (`qos`, `reason`, `group`,
`topic`, …). The service and instance are what Prometheus adds as `job` / `instance` from its scrape config
(infra/otel/collector.yaml), so they are not repeated here.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "tbmq_"

# seconds: from a Redis call on an idle machine (~0.2 ms) to a stalled one
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

Read = Callable[[], object]  # -> a number, or {label values tuple (or one value): number}; may be async


@dataclass
class _Source:
    name: str
    doc: str
    kind: str                 # "counter" | "gauge"
    labels: tuple[str, ...]
    read: Read


class Metrics:
    """One service process's metrics. Register sources at start-up; `await exposition()` renders them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        ProcessCollector(registry=self.registry)
        self._sources: list[_Source] = []
        self._values: dict[str, object] = {}
        self._lags: dict[str, list[Callable[[], Iterable[tuple[str, object]]]]] = {}
        self.registry.register(self)

    # -- registration ------------------------------------------------------------------------------------
    def counter(self, name: str, doc: str, read: Read, labels: Iterable[str] = ()) -> None:
        """A monotonic count the service keeps (`read()` at scrape time); exposed as tbmq_<name>_total."""
        self._sources.append(_Source(name, doc, "counter", tuple(labels), read))

    def gauge(self, name: str, doc: str, read: Read, labels: Iterable[str] = ()) -> None:
        """A current value (`read()` at scrape time)."""
        self._sources.append(_Source(name, doc, "gauge", tuple(labels), read))

    def counters_by(self, name: str, doc: str, stats: Mapping[str, int], label: str,
                    keys: Mapping[str, str]) -> None:
        """One counter with one label whose values map keys of a stats dict: keys = {label value: stats key}."""
        self.counter(name, doc, lambda: {(v,): stats.get(k, 0) for v, k in keys.items()}, (label,))

    def lag(self, name: str, consumers: Callable[[], Iterable[tuple[str, object]]]) -> None:
        """Consumer lag per (group, topic, partition): the high watermark the consumer last fetched minus its
        position, for every partition assigned to each (group, aiokafka consumer) `consumers()` yields. A second
        `lag` of the same name (two services in one process: a router running device-persistence) adds its
        consumers to the same metric."""
        if name in self._lags:
            self._lags[name].append(consumers)
            return
        sources = self._lags[name] = [consumers]

        async def read() -> dict:
            out: dict[tuple, float] = {}
            for group, consumer in (c for source in sources for c in source()):
                for tp in list(consumer.assignment()):
                    high = consumer.highwater(tp)
                    if high is None:
                        continue
                    try:
                        pos = await consumer.position(tp)
                    except Exception:  # not positioned yet (a rebalance): no sample
                        continue
                    out[(group, tp.topic, str(tp.partition))] = max(0, high - pos)
            return out

        self.gauge(name, "records appended to the partition and not yet consumed by the group", read,
                   ("group", "topic", "partition"))

    def histogram(self, name: str, doc: str, labels: Iterable[str] = (),
                  buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
        """A latency histogram the service observes per call (seconds): tbmq_<name>_seconds."""
        return Histogram(PREFIX + name + "_seconds", doc, tuple(labels), registry=self.registry, buckets=buckets)

    # -- exposition --------------------------------------------------------------------------------------
    async def exposition(self) -> bytes:
        """Read every source (async ones awaited here, on the service's loop), then render."""
        values: dict[str, object] = {}
        for s in self._sources:
            try:
                v = s.read()
                if inspect.isawaitable(v):
                    v = await v
                values[s.name] = v
            except Exception:  # one broken source must not hide the others
                log.exception("metric %s could not be read", s.name)
        self._values = values
        return generate_latest(self.registry)

    def collect(self):  # the prometheus_client Collector protocol (called by generate_latest)
        for s in self._sources:
            if s.name not in self._values:
                continue
            v = self._values[s.name]
            fam_cls = CounterMetricFamily if s.kind == "counter" else GaugeMetricFamily
            fam = fam_cls(PREFIX + s.name, s.doc, labels=list(s.labels))
            if isinstance(v, Mapping):
                for key, num in v.items():
                    key = key if isinstance(key, tuple) else (key,)
                    fam.add_metric([str(k) for k in key], float(num))
            elif v is not None:
                fam.add_metric([], float(v))
            yield fam


async def observe(hist: Histogram, labels: tuple[str, ...], call: Awaitable):
    """`await call`, observing its duration in `hist` (labels) whether it succeeds or fails."""
    t0 = time.perf_counter()
    try:
        return await call
    finally:
        (hist.labels(*labels) if labels else hist).observe(time.perf_counter() - t0)


class GrpcClientLatency:
    """A grpc.aio unary-unary and unary-stream client interceptor: `observe(method, seconds)` for every call
    made on the channel, failed ones included (`method` = the RPC's name, e.g. "AcknowledgeMany"); a
    unary-stream call (e.g. "FetchUndeliveredParts") from its start to its end: its last answer read, its
    failure or its cancellation. `observe` is looked up per call through `get()`, so a Metrics source can be
    attached after the channel exists."""

    def __init__(self, get: Callable[[], Callable[[str, float], None] | None]) -> None:
        self._get = get

    @staticmethod
    def _method(client_call_details) -> str:
        method = client_call_details.method
        if isinstance(method, bytes):
            method = method.decode()
        return method.rsplit("/", 1)[-1]

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        t0 = time.perf_counter()
        call = await continuation(client_call_details, request)
        observe = self._get()
        if observe is None:
            return call
        try:
            await call
        except Exception:
            pass  # the caller sees the error when it awaits the call
        observe(self._method(client_call_details), time.perf_counter() - t0)
        return call

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        t0 = time.perf_counter()
        call = await continuation(client_call_details, request)
        observe = self._get()
        if observe is not None:  # the answers are the caller's to read: timed to the call's end
            method = self._method(client_call_details)
            call.add_done_callback(lambda _: observe(method, time.perf_counter() - t0))
        return call


def grpc_client_interceptors(get: Callable[[], Callable[[str, float], None] | None]) -> list:
    """GrpcClientLatency as a grpc.aio unary-unary and a unary-stream client interceptor (a channel takes
    each interceptor as one kind only), for grpc.aio channels."""
    import grpc

    class _Unary(GrpcClientLatency, grpc.aio.UnaryUnaryClientInterceptor):
        pass

    class _Stream(GrpcClientLatency, grpc.aio.UnaryStreamClientInterceptor):
        pass

    return [_Unary(get), _Stream(get)]


__all__ = ["CONTENT_TYPE", "LATENCY_BUCKETS", "Metrics", "grpc_client_interceptors", "observe"]
