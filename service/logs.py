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


OURS = ("service", "compressor", "exporters")  # the packages whose loggers say what a job does

# Third-party records that say nothing about a job, each with why it is dropped here rather than fixed at
# its source: (logger, the start of the message).
IRRELEVANT = (
    # torch.onnx's dynamo exporter registers torchvision's ONNX functions on its first export and, where
    # torchvision is not installed (the CPU machines here), warns once per op; no model of ours uses them.
    ("torch.onnx._internal.exporter._registration", "torchvision is not installed."),
)


# Python warnings of the same kind: (category, message regex).
IRRELEVANT_WARNINGS = (
    # torch.export's run_decompositions (inside torch.onnx.export) deep-copies its own module call graph,
    # whose pytree LeafSpec objects warn about their deprecation when re-created; nothing we call or pass.
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
    # torch.onnx names the dynamic axes after our Dims; inputs that share one (input_ids and attention_mask
    # share `batch` and `sequence`, as they must) make it warn that the name is taken by ... the same name.
    (UserWarning, r"# The axis name: (\w+) will not be used, since it shares the same shape constraints with "
                  r"another axis: \1\.$"),
)


class _Irrelevant(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def drop_irrelevant() -> None:
    """Filter the IRRELEVANT records on their own loggers only, the IRRELEVANT_WARNINGS by their message,
    and turn off transformers' weight-loading progress bar (idempotent)."""
    import os
    import warnings

    # transformers draws a "Loading weights" progress bar on every from_pretrained (the hub's switch turns
    # it off; read when transformers is first imported, which is after this); nothing is downloaded here
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for category, message in IRRELEVANT_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, prefix in IRRELEVANT:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Irrelevant) and f.prefix == prefix for f in logger.filters):
            logger.addFilter(_Irrelevant(prefix))


def configure(log_format: str = "json", *, ours: int = logging.INFO, others: int = logging.WARNING) -> None:
    """Root handler on stderr; our loggers at `ours`, third-party ones at `others` (exporter passes are
    chatty at INFO), IRRELEVANT records dropped."""
    drop_irrelevant()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.addFilter(_OperationFilter())
    logging.getLogger().handlers[:] = [handler]
    set_levels(ours=ours, others=others)


def set_levels(*, ours: int, others: int) -> None:
    """Our packages' loggers at `ours`, every other library's (through the root logger) at `others`."""
    logging.getLogger().setLevel(others)
    for name in OURS:
        logging.getLogger(name).setLevel(ours)
