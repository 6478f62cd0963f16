"""Logging set-up: JSON lines or console, both carrying the current trace and span ids."""

from __future__ import annotations

import json
import logging
import sys
import time

from opentelemetry import trace

_RESERVED = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class _TraceIds(logging.Filter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = trace.get_current_span().get_span_context()
        record.trace_id = format(ctx.trace_id, "032x") if ctx.is_valid else ""
        record.span_id = format(ctx.span_id, "016x") if ctx.is_valid else ""
        record.service = self.service
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": getattr(record, "service", ""),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if getattr(record, "trace_id", ""):
            out["trace_id"] = record.trace_id
            out["span_id"] = record.span_id
        for key, value in record.__dict__.items():
            if key not in _RESERVED and key not in out and key not in ("trace_id", "span_id", "service"):
                out[key] = value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


class ConsoleFormatter(logging.Formatter):
    def __init__(self):
        super().__init__("%(asctime)s %(levelname)-5s %(service)s %(name)s: %(message)s%(trace)s")

    def format(self, record: logging.LogRecord) -> str:
        record.trace = f" [trace={record.trace_id}]" if getattr(record, "trace_id", "") else ""
        return super().format(record)


def configure_logging(service: str, fmt: str = "console", level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else ConsoleFormatter())
    handler.addFilter(_TraceIds(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("aiokafka", "kafka", "faust", "mode", "grpc"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(level)))
