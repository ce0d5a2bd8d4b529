"""Logging for the server and its workers: one JSON object per line carrying the operation id, or text.

The operation id travels in a context variable: each RPC and each job's supervising task runs in its own
asyncio context, and a worker process sets it once, so every record logged on a job's behalf names it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from collections.abc import Iterator
from contextvars import ContextVar

operation_id: ContextVar[str | None] = ContextVar("operation_id", default=None)


@contextlib.contextmanager
def operation_context(name: str | None) -> Iterator[None]:
    token = operation_id.set(name)
    try:
        yield
    finally:
        operation_id.reset(token)


class _OperationFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "operation", None) is None:
            record.operation = operation_id.get()
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if getattr(record, "operation", None):
            entry["operation"] = record.operation
        if record.process:
            entry["pid"] = record.process
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        operation = getattr(record, "operation", None)
        return f"{text} [{operation}]" if operation else text


def configure(log_format: str = "json", *, ours: int = logging.INFO, others: int = logging.WARNING) -> None:
    """Root handler on stderr; our loggers at `ours`, third-party ones at `others` (exporter passes are
    chatty at INFO)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.addFilter(_OperationFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(others)
    for name in ("service", "compressor", "exporters"):
        logging.getLogger(name).setLevel(ours)
