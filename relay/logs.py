"""Logging: one JSON object per line (or plain text for a console), never a secret.

Handlers pass ids as ``extra=``; only the keys in ``FIELDS`` are written, so an
accidental ``extra`` with a body or a key never reaches the output.
"""

from __future__ import annotations

import json
import logging
import sys
import time

FIELDS = (
    "request_id",
    "run_id",
    "token",
    "job",
    "provider",
    "sandbox_id",
    "state",
    "error_code",
    "error_class",
    "method",
    "path",
    "status",
    "duration_ms",
    "delivery_id",
    "attempt",
)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        for key in FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                line[key] = value
        return json.dumps(line)


class ConsoleFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        extras = " ".join(
            f"{key}={getattr(record, key)}" for key in FIELDS if getattr(record, key, None)
        )
        return (
            f"{record.levelname.lower():7} {record.name}: {record.getMessage()} {extras}".rstrip()
        )


def configure(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else ConsoleFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("uvicorn.access", "httpx", "httpcore", "hpack", "grpclib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
