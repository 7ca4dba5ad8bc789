"""Logging: one JSON object per line (or plain text for a console), never a secret.

Handlers pass ids as ``extra=``; only the keys in ``FIELDS`` are written, so an
accidental ``extra`` with a body or a key never reaches the output.

Ids that hold for a whole request or run (request id, run id, token name, provider) are
bound once with :func:`bind` and land on every line written in that context, including
the run's own task (``asyncio`` copies the context into a task when it is created).
"""

from __future__ import annotations

import codecs
import contextvars
import io
import json
import logging
import math
import os
import sys
import time
import traceback
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

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
    "exit_code",
    "stdout_bytes",
    "stderr_bytes",
    "traceback",
)

_INDEX = {key: index for index, key in enumerate(FIELDS)}


class _Bound:
    """The ids bound in a context, never changed once made (:func:`bind` makes a new one),
    so the JSON pieces of its string values can be kept with it: a run's ids are bound once
    and written on each of its lines."""

    __slots__ = ("_pieces", "fields")

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = fields
        self._pieces: list[str] | None = None

    def pieces(self) -> list[str]:
        """Each field's ``, "key": value`` as the JSON line writes it, at its index in
        ``FIELDS`` ("" where none is bound); kept when every value is a string, which
        nothing can change after the fact (any other value is written afresh each time)."""
        pieces = self._pieces
        if pieces is None:
            pieces = [""] * len(FIELDS)
            fixed = True
            for key, value in self.fields.items():
                index = _INDEX.get(key)
                if type(value) is str:
                    if index is not None:
                        pieces[index] = _JSON_KEYS[index] + _json_string(value)
                else:
                    fixed = False
                    if index is not None:
                        pieces[index] = _JSON_KEYS[index] + _json_value(value)
            if fixed:
                self._pieces = pieces
        return pieces


_context: contextvars.ContextVar[_Bound] = contextvars.ContextVar("relay_log_context")
_NOTHING_BOUND = _Bound({})


def bind(**fields: Any) -> None:
    """Add ids to every line logged from here on in this context (None values are skipped)."""
    bound = _context.get(_NOTHING_BOUND).fields.copy()
    for key, value in fields.items():  # a loop, not a comprehension: no frame of its own
        if value is not None:
            bound[key] = value
    _context.set(_Bound(bound))


def fresh_context() -> contextvars.Token[_Bound]:
    """Start an empty context (a new request); pass the result to :func:`restore`."""
    return _context.set(_NOTHING_BOUND)


def restore(token: contextvars.Token[_Bound]) -> None:
    _context.reset(token)


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    """The allowed fields of a record: its own ``extra`` first, then the bound ids."""
    return _add_fields({}, record.__dict__)  # ``extra`` lands in the record's __dict__


def _add_fields(line: dict[str, Any], own: Mapping[str, Any]) -> dict[str, Any]:
    """Add to ``line`` the allowed fields, in ``FIELDS`` order: ``own``'s value, else the
    bound one; a field that is None in both is left out."""
    bound = _context.get(_NOTHING_BOUND).fields
    for key in FIELDS:
        value = own.get(key)
        if value is None:
            value = bound.get(key)
        if value is not None:
            line[key] = value
    return line


# allow_nan=False: Python's encoder would write a NaN or an infinity as the bare words
# ``NaN`` and ``Infinity``, which no JSON parser accepts (a log pipeline drops the line).
_json_encoder = json.JSONEncoder(default=str, allow_nan=False)
_json_string = json.encoder.encode_basestring_ascii
_JSON_KEYS = tuple(f", {_json_string(key)}: " for key in FIELDS)


def _json_value(value: Any) -> str:
    """``value`` as ``json.JSONEncoder(default=str)`` writes it inside an object, except a
    float that is not a number (NaN, an infinity, anywhere in the value): ``null``, which
    keeps the line JSON and the field's type a number or nothing. Strings, plain ints and
    finite floats as the C encoder writes them (the ascii escaper, ``int.__repr__``,
    ``float.__repr__``), anything else by the encoder itself."""
    kind = type(value)
    if kind is str:
        return _json_string(value)
    if kind is int:
        try:
            return int.__repr__(value)
        except ValueError:  # past Python's int-to-str limit (4300 digits)
            return _json_string(_too_long(value))
    if kind is float:
        return float.__repr__(value) if math.isfinite(value) else "null"
    try:
        return _json_encoder.encode(value)
    except ValueError:  # a NaN, an infinity or a too long int inside (or a circular value)
        return _json_encoder.encode(_finite(value))


def _too_long(value: int) -> str:
    """What is written for an int past Python's int-to-str limit (``sys.int_info``'s 4300
    digits by default), which neither ``repr`` nor the encoder will write: its size."""
    digits = int(value.bit_length() * math.log10(2)) + 1  # the count, or one over it
    return f"<an integer of about {digits} digits>"


def _finite(value: Any, depth: int = 0) -> Any:
    """``value`` with each float that is not a number made None, and each int too long to
    write made :func:`_too_long`'s text, through the lists, tuples and dicts the encoder
    walks (a circular one is cut at a depth no line needs)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, int):
        try:
            int.__repr__(value)
        except ValueError:
            return _too_long(value)
        return value
    if depth > 32:
        return str(value)
    if isinstance(value, dict):  # a key is a string in JSON: a NaN one is "NaN", as it was
        return {_key(key): _finite(item, depth + 1) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item, depth + 1) for item in value]
    return value


def _key(key: Any) -> Any:
    """A dict key as the encoder wrote it before it refused NaN: a float that is not a
    number as the text ``repr`` gives it in JSON's words (``NaN``, ``Infinity``)."""
    if isinstance(key, float) and not math.isfinite(key):
        return "NaN" if key != key else ("Infinity" if key > 0 else "-Infinity")
    return _finite(key) if isinstance(key, int) else key


class LineFormatter(logging.Formatter):
    """A formatter whose line is made of the parts :class:`RelayLogger` has at hand without
    a record; ``format(record)`` passes the record's parts, so both paths write one text."""

    def format(self, record: logging.LogRecord) -> str:
        return self.format_parts(
            record.name,
            record.levelname,
            record.created,
            record.msecs,
            record.getMessage(),
            record.__dict__,  # ``extra`` lands here
        )

    def format_parts(
        self,
        logger: str,
        level: str,
        created: float,
        msecs: float,
        event: str,
        own: Mapping[str, Any],
    ) -> str:
        raise NotImplementedError


_MILLIS = tuple(f"{millis:03d}" for millis in range(1000))


class JsonFormatter(LineFormatter):
    """Written for every line the relay logs, several per run: the timestamp's seconds are
    formatted once a second, and the line is put together from its escaped parts."""

    _second = -1
    _second_text = ""
    _HEADS_KEPT = 512

    def __init__(self) -> None:
        super().__init__()
        # The text after a line's milliseconds up to its fields, per (level, logger, event):
        # the relay's events are a few fixed texts. One made of a message's values (another
        # library's line) would fill it, so it starts over when full.
        self._heads: dict[tuple[str, str, str], str] = {}

    def format_parts(
        self,
        logger: str,
        level: str,
        created: float,
        msecs: float,
        event: str,
        own: Mapping[str, Any],
    ) -> str:
        second = int(created)
        if second != self._second:
            # Digits and "-T:" only: the escaper would leave them as they are.
            self._second_text = time.strftime('{"ts": "%Y-%m-%dT%H:%M:%S.', time.gmtime(second))
            self._second = second
        # The text json.JSONEncoder(default=str) writes for {"ts": ..., "level": ...,
        # "logger": ..., "event": ..., **fields}, built from its parts: the encoder's own
        # per-call setup cost more than the line.
        heads = self._heads
        kept = (level, logger, event)
        tail = heads.get(kept)
        if tail is None:
            if len(heads) >= self._HEADS_KEPT:
                heads.clear()
            tail = heads[kept] = (
                f'Z", "level": {_json_string(level.lower())}, "logger": {_json_string(logger)}, '
                f'"event": {_json_string(event)}'
            )
        millis = int(msecs)
        millis_text = _MILLIS[millis] if 0 <= millis < 1000 else format(millis, "03d")
        head = f"{self._second_text}{millis_text}{tail}"
        # As _add_fields: the bound ids' pieces (kept with them), each replaced by the line's
        # own value of that field; only the few own keys are looked at, not all of FIELDS.
        bound = _context.get(_NOTHING_BOUND)
        pieces = bound.pieces()
        mine: list[str] | None = None
        if own:
            bound_fields = bound.fields
            for key, value in own.items():
                if value is None:
                    continue
                index = _INDEX.get(key)
                if index is None or value is bound_fields.get(key):  # the same text
                    continue
                if mine is None:
                    mine = pieces.copy()
                if type(value) is str:  # _json_value's commonest case
                    mine[index] = _JSON_KEYS[index] + _json_string(value)
                else:
                    mine[index] = _JSON_KEYS[index] + _json_value(value)
        return _blank(f"{head}{''.join(pieces if mine is None else mine)}}}")


class ConsoleFormatter(LineFormatter):
    def format_parts(
        self,
        logger: str,
        level: str,
        created: float,
        msecs: float,
        event: str,
        own: Mapping[str, Any],
    ) -> str:
        extras = " ".join(f"{key}={_text(value)}" for key, value in _add_fields({}, own).items())
        return _blank(f"{level.lower():7} {logger}: {event} {extras}".rstrip())


def _text(value: Any) -> str:
    """``value`` as a console line shows it; an int too long to write (alone or inside) as
    :func:`_too_long` says."""
    try:
        return f"{value}"
    except ValueError:
        return f"{_finite(value)}"


OWN_LOGGERS = ("relay", "uvicorn")
"""Loggers whose debug and info lines are written; every other library (provider SDKs and
their HTTP stacks, which log headers and bodies at debug) is heard from warning up."""
REDACTED = "[redacted]"
_MIN_SECRET_CHARS = 6


_secrets: list[str] = []


def redact(values: Iterable[str]) -> None:
    """Blank these values (the settings' secrets) in every line written from now on, as
    they are and as a JSON line writes them: a key with a quote, a backslash or a non-ASCII
    character is escaped there (``\\"``, ``\\u00e9``), and would not match as it is."""
    kept = [value for value in values if len(value) >= _MIN_SECRET_CHARS]
    known = {*_secrets, *kept, *(_json_string(value)[1:-1] for value in kept)}
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


_own_names: dict[str, bool] = {}


def _is_own(name: str) -> bool:
    """Whether OwnLinesFilter passes the debug and info lines of logger ``name``."""
    own = _own_names.get(name)
    if own is None:
        own = _own_names[name] = name.split(".")[0] in OWN_LOGGERS
    return own


class OwnLinesFilter(logging.Filter):
    """Drops other libraries' debug and info lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or _is_own(record.name)


if sys.version_info >= (3, 13):

    def _clock() -> tuple[float, float]:
        """A line's time as ``logging.LogRecord`` takes it on this Python."""
        now = time.time_ns()
        return now / 1e9, (now % 1_000_000_000) // 1_000_000 + 0.0

else:

    def _clock() -> tuple[float, float]:
        """A line's time as ``logging.LogRecord`` takes it on this Python."""
        now = time.time()
        return now, int((now - int(now)) * 1000) + 0.0


_FIELD_NAMES = frozenset(FIELDS)
_PLAIN_ENCODINGS = frozenset({"utf-8", "ascii", "iso8859-1"})
_NO_EXTRA: dict[str, Any] = {}


def _over_file(layer: object) -> bool:
    """Whether ``layer`` (a text stream's buffer) writes to a file's descriptor as it is:
    the file itself, or a write buffer over it."""
    if type(layer) is io.BufferedWriter:
        layer = layer.raw
    return type(layer) is io.FileIO


class _Sink:
    """The handler :func:`configure` installed, and what it installed on it."""

    def __init__(
        self, handler: logging.StreamHandler[Any], formatter: LineFormatter, own: OwnLinesFilter
    ) -> None:
        self.handler, self.formatter, self.own = handler, formatter, own
        # The stream _file_of last looked at, its encoding and error handler then (a
        # ``reconfigure`` of either makes a new one), and its answer.
        self._stream: Any = None
        self._stream_encoding: object = None
        self._stream_errors: object = None
        self._file, self._encoding, self._errors = -1, "", ""

    def _file_of(self, stream: object) -> int:
        """The file descriptor a line can be written to directly, without the stream's text
        and buffer layers, as the bytes the stream would write: its own encoding of the text
        (one without a state or a byte-order mark) on a system whose line end is "\\n",
        which a text file writes as it is (the relay's streams are stderr, which Python
        opens so, and files opened with ``open``'s default; one opened with
        ``newline="\\r\\n"`` would not be told apart). -1 for any other stream (a memory
        one, a wrapper of another class, a text layer over a compressor or a socket): the
        line goes through the stream."""
        found, encoding, errors = -1, "", ""
        if (
            type(stream) is io.TextIOWrapper
            and os.linesep == "\n"
            # A file of its own descriptor, buffered or not (``python -u``'s stderr): a text
            # layer over anything else (a compressor, ``gzip.open(path, "wt")``; a socket's
            # file) may answer fileno() with a descriptor whose bytes are not the text's.
            and _over_file(stream.buffer)
        ):
            encoding, errors = codecs.lookup(stream.encoding).name, stream.errors or "strict"
            try:
                found = stream.fileno() if encoding in _PLAIN_ENCODINGS else -1
            except (OSError, ValueError):  # no descriptor (a closed stream, a memory one)
                found = -1
        self._stream, self._stream_encoding = stream, getattr(stream, "encoding", None)
        self._stream_errors = getattr(stream, "errors", None)
        self._file, self._encoding, self._errors = found, encoding, errors
        return found

    def carries(self, logger: logging.Logger, level: int) -> bool:
        """Whether logging would hand a line of ``logger`` at ``level`` to this handler alone,
        and its filter would let it through: the logger is enabled and has no filter, no
        logger from it up to the root has a handler or stops the line, the root has this one
        handler, still with its level, formatter and filter only, and records are plain
        ``LogRecord`` (a factory could add attributes). Anything else, such as a capturing
        handler a test added, takes logging's own path."""
        handler = self.handler
        filters = handler.filters
        if (
            logger.disabled
            or logger.filters
            or level < handler.level
            or handler.formatter is not self.formatter
            or len(filters) != 1
            or filters[0] is not self.own
            or logging.getLogRecordFactory() is not logging.LogRecord
        ):
            return False
        if level < logging.WARNING and not _is_own(logger.name):  # OwnLinesFilter's test
            return False
        node = logger
        while (parent := node.parent) is not None:
            if node.handlers or not node.propagate:
                return False
            node = parent
        handlers = node.handlers
        return len(handlers) == 1 and handlers[0] is handler

    def write(self, logger: logging.Logger, level: int, event: str, own: Mapping[str, Any]) -> None:
        """What the handler's ``handle`` and ``emit`` do with the record, without the record:
        the same text, written and flushed under the handler's lock; a failing write goes to
        ``handleError`` (which reports it on stderr) and never into the caller."""
        handler = self.handler
        created, msecs = _clock()
        lock = handler.lock  # what handler.acquire() takes, without its call
        if lock is not None:
            lock.acquire()
        try:
            text = self.formatter.format_parts(
                logger.name, logging.getLevelName(level), created, msecs, event, own
            )
            stream = handler.stream
            # Only a text file's encoding and error handler are looked at: any other
            # stream never takes the short path, and may have neither attribute.
            file = (
                self._file
                if stream is self._stream
                and (
                    type(stream) is not io.TextIOWrapper
                    or (
                        stream.encoding is self._stream_encoding
                        and stream.errors is self._stream_errors
                    )
                )
                else self._file_of(stream)
            )
            if file >= 0:
                # One write(2) of the line, instead of the text layer's encode and copy into
                # the buffer and the buffer's write of it. The flush first writes whatever
                # another writer left in the stream's buffer (nothing, mostly: no write
                # call), so lines keep their order with everything else written to it.
                data = (text + handler.terminator).encode(self._encoding, self._errors)
                try:
                    stream.flush()
                    while data:  # a regular file or a pipe takes it whole, barring a signal
                        data = data[os.write(file, data) :]
                except BlockingIOError:
                    # A pipe another process made non-blocking, its reader behind: what it
                    # did not take waits in the stream's buffer, as the stream keeps it, and
                    # goes first at the next flush (the next line's): no line cut or lost.
                    stream.buffer.write(data)
            else:
                stream.write(text + handler.terminator)
                if stream and hasattr(stream, "flush"):  # StreamHandler.flush's test
                    stream.flush()
        except RecursionError:  # as StreamHandler.emit does
            raise
        except Exception:
            record = logger.makeRecord(
                logger.name,
                level,
                "(unknown file)",
                0,
                event,
                (),
                None,
                "(unknown function)",
                dict(own),
            )
            handler.handleError(record)
        finally:
            if lock is not None:
                lock.release()


class RelayLogger(logging.Logger):
    """The relay's loggers. A line without ``%`` arguments, exception or stack, whose
    ``extra`` holds only ``FIELDS``, is written straight to the handler :func:`configure`
    installed while that configuration is the one in place (:meth:`_Sink.carries`): the
    same text logging would write, without building a record and dispatching it, which
    is most of a line's cost. Every other line, and every line under another
    configuration, takes logging's own path."""

    sink: ClassVar[_Sink | None] = None

    def info(
        self,
        msg: object,
        *args: object,
        exc_info: Any = None,
        stack_info: bool = False,
        stacklevel: int = 1,
        extra: Mapping[str, object] | None = None,
    ) -> None:
        """``Logger.info``, without packing and unpacking its keywords (the relay's most
        frequent call), and with :meth:`_log`'s test for the short path in line."""
        if not self.isEnabledFor(logging.INFO):
            return
        sink = RelayLogger.sink
        if (
            sink is not None
            and not args
            and not exc_info
            and not stack_info
            and type(msg) is str
            and (extra is None or (type(extra) is dict and _FIELD_NAMES.issuperset(extra)))
            and sink.carries(self, logging.INFO)
        ):
            sink.write(self, logging.INFO, msg, _NO_EXTRA if extra is None else extra)
            return
        # One frame more to step over for the caller's file and line (logging's own frames
        # are skipped, this module's are not).
        super()._log(logging.INFO, msg, args, exc_info, extra, stack_info, stacklevel + 1)

    def _log(
        self,
        level: int,
        msg: object,
        args: Any,
        exc_info: Any = None,
        extra: Mapping[str, object] | None = None,
        stack_info: bool = False,
        stacklevel: int = 1,
    ) -> None:
        sink = RelayLogger.sink
        if (
            sink is None
            or args
            or exc_info
            or stack_info
            or type(msg) is not str
            or (
                extra is not None
                and (type(extra) is not dict or not _FIELD_NAMES.issuperset(extra))
            )
            or not sink.carries(self, level)
        ):
            super()._log(level, msg, args, exc_info, extra, stack_info, stacklevel + 1)
            return
        sink.write(self, level, msg, _NO_EXTRA if extra is None else extra)


def _adopt_own_loggers() -> None:
    """Make the relay's existing loggers :class:`RelayLogger`s. Modules make their loggers
    when they are imported, mostly before :func:`configure` runs, so the class is set on
    the ones that exist (the subclass adds no state, only methods); a logger of another
    library, or one of another class, is left as it is, and one made later takes logging's
    own path (the same line, at the ordinary cost)."""
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        own = name == "relay" or name.startswith("relay.")
        if own and type(logger) is logging.Logger:
            logger.__class__ = RelayLogger


def configure(level: str, fmt: str) -> None:
    """Log to stderr as JSON (or console text)."""
    # Fields no line of ours shows; skipping them makes each record cheaper (the logging
    # HOWTO's "Optimization" section lists these switches, _srcfile included).
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging._srcfile = None  # no caller lookup per line
    handler = logging.StreamHandler(sys.stderr)
    formatter = JsonFormatter() if fmt == "json" else ConsoleFormatter()
    handler.setFormatter(formatter)
    own = OwnLinesFilter()
    handler.addFilter(own)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)  # relay.access instead
    RelayLogger.sink = _Sink(handler, formatter, own)
    _adopt_own_loggers()


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
