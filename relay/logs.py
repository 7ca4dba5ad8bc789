"""Logging: one JSON object per line (or plain text for a console), never a secret.

Handlers pass ids as ``extra=``; only the keys in ``FIELDS`` are written, so an
accidental ``extra`` with a body or a key never reaches the output.

Ids that hold for a whole request or run (request id, run id, token name, provider) are
bound once with :func:`bind` and land on every line written in that context, including
the run's own task (``asyncio`` copies the context into a task when it is created).
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
import traceback
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, SecretStr

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
    "route",
    "path",
    "status",
    "duration_ms",
    "delivery_id",
    "attempt",
    "traceback",
)

_context: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("relay_log_context")
_NOTHING_BOUND: dict[str, Any] = {}


def bind(**fields: Any) -> None:
    """Add ids to every line logged from here on in this context (None values are skipped)."""
    current = _context.get({})
    _context.set({**current, **{k: v for k, v in fields.items() if v is not None}})


def fresh_context() -> contextvars.Token[dict[str, Any]]:
    """Start an empty context (a new request); pass the result to :func:`restore`."""
    return _context.set({})


def restore(token: contextvars.Token[dict[str, Any]]) -> None:
    _context.reset(token)


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    """The allowed fields of a record: its own ``extra`` first, then the bound ids."""
    bound = _context.get(_NOTHING_BOUND)
    own = record.__dict__  # ``extra`` lands here
    values: dict[str, Any] = {}
    for key in FIELDS:
        value = own.get(key)
        if value is None:
            value = bound.get(key)
        if value is not None:
            values[key] = value
    return values


class JsonFormatter(logging.Formatter):
    """Written for every line the relay logs, several per run: the timestamp's seconds are
    formatted once a second and one encoder serves every line."""

    _encode = json.JSONEncoder(default=str).encode
    _second = -1
    _second_text = ""

    def format(self, record: logging.LogRecord) -> str:
        second = int(record.created)
        if second != self._second:
            self._second_text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._second = second
        line = {
            "ts": f"{self._second_text}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        line.update(fields_of(record))
        return _blank(self._encode(line))


class ConsoleFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        extras = " ".join(f"{key}={value}" for key, value in fields_of(record).items())
        return _blank(
            f"{record.levelname.lower():7} {record.name}: {record.getMessage()} {extras}".rstrip()
        )


OWN_LOGGERS = ("relay", "uvicorn")
"""Loggers whose debug and info lines are written; every other library (provider SDKs and
their HTTP stacks, which log headers and bodies at debug) is heard from warning up."""
REDACTED = "[redacted]"
_MIN_SECRET_CHARS = 6


_secrets: list[str] = []


def redact(values: Iterable[str]) -> None:
    """Blank these values (the settings' secrets) in every line written from now on."""
    known = {*_secrets, *(value for value in values if len(value) >= _MIN_SECRET_CHARS)}
    _secrets[:] = sorted(known, key=len, reverse=True)


def redact_settings(settings: BaseModel) -> None:
    """:func:`redact` every ``SecretStr`` setting's value."""
    values = (getattr(settings, name) for name in type(settings).model_fields)
    redact(value.get_secret_value() for value in values if isinstance(value, SecretStr))


def _blank(line: str) -> str:
    for secret in _secrets:
        if secret in line:
            line = line.replace(secret, REDACTED)
    return line


class OwnLinesFilter(logging.Filter):
    """Drops other libraries' debug and info lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        own = record.name.split(".")[0] in OWN_LOGGERS
        return own or record.levelno >= logging.WARNING


def configure(level: str, fmt: str) -> None:
    """Log to stderr as JSON (or console text)."""
    # Fields no line of ours shows; skipping them makes each record cheaper (the logging
    # HOWTO's "Optimization" section lists these switches, _srcfile included).
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging._srcfile = None  # no caller lookup per line
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else ConsoleFormatter())
    handler.addFilter(OwnLinesFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)  # relay.access instead


def traceback_of(error: BaseException) -> str:
    """The stack of ``error`` and of the errors it came from, for a log line, told without
    anything the program held: each frame's file, line, function and source text, and each
    error's class name. Frame locals are not read, and no error's message is kept: an
    unexpected error's message may quote a request body, a header or a key (an SDK's URL,
    a ``KeyError`` of a caller's value), and the class and the place find the bug."""
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        frames = traceback.extract_tb(current.__traceback__)  # no locals captured
        kind = type(current)
        stack = "".join(traceback.format_list(frames))
        parts.append(f"{kind.__module__}.{kind.__qualname__} (message not logged)\n{stack}")
        current = current.__cause__ or (
            None if current.__suppress_context__ else current.__context__
        )
    return "\nwhich came from: ".join(parts).rstrip()
