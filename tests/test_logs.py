"""Structured logs: one JSON object per line, carrying request id, run id, token name and
provider; the caller's X-Request-Id is honoured and returned."""

from __future__ import annotations

import bz2
import concurrent.futures
import contextlib
import gzip
import io
import json
import logging
import lzma
import math
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import httpx
import hypothesis
import pytest
from hypothesis import strategies as st
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.testclient import TestClient

from relay import logs
from relay.auth import new_token
from relay.http.app import create_app
from testing.relay_server import SECRET_CANARY, RelayProcess
from tests.conftest import make_settings


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    server = RelayProcess(tmp_path_factory.mktemp("logs"), local_isolation="bwrap", drain_s=1)
    server.add_token("logger", command=True)
    server.start()
    yield server
    server.stop()


def lines(relay: RelayProcess) -> list[dict[str, Any]]:
    parsed = []
    for raw in relay.log().splitlines():
        line = json.loads(raw)  # every line is one JSON object
        assert {"ts", "level", "logger", "event"} <= set(line), line
        parsed.append(line)
    return parsed


def wait_for(relay: RelayProcess, test: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
    """All lines, once one passes ``test`` (a request's line follows its answer)."""
    deadline = time.monotonic() + 5
    while True:
        found = lines(relay)
        if any(test(line) for line in found):
            return found
        assert time.monotonic() < deadline, "the line never came"
        time.sleep(0.02)


@pytest.mark.slow  # needs a relay process: seconds
def test_a_run_logs_its_ids_on_every_line(relay: RelayProcess) -> None:
    token = relay.tokens["logger"]
    answer = relay.post(
        token, {"job": "echo", "params": {"message": "x"}}, **{"X-Request-Id": "trace-41"}
    )
    assert answer.status_code == 200 and answer.headers["x-request-id"] == "trace-41"
    run_id = answer.json()["id"]
    relay.get(token, f"/v1/runs/{run_id}")
    found = wait_for(relay, lambda line: line.get("route") == "/v1/runs/{run_id}")
    mine = [line for line in found if line.get("run_id") == run_id]
    events = [line["event"] for line in mine]
    assert events[:3] == ["run submitted", "run finished", "request"], events
    for line in mine[:3]:
        assert line["request_id"] == "trace-41"
        assert (line["token"], line["job"], line["provider"]) == ("logger", "echo", "local")
    access = mine[2]
    assert access["logger"] == "relay.access"
    assert (access["method"], access["route"], access["status"]) == ("POST", "/v1/runs", 200)
    assert isinstance(access["duration_ms"], float)
    poll = mine[3]
    assert (poll["event"], poll["route"], poll["status"]) == ("request", "/v1/runs/{run_id}", 200)
    assert poll["request_id"].startswith("req_") and poll["token"] == "logger"
    assert "job" not in poll  # ids bound for one request never leak into the next


@pytest.mark.slow  # needs a relay process: seconds
def test_request_ids_stay_with_their_own_requests(relay: RelayProcess) -> None:
    token = relay.tokens["logger"]

    def submit(n: int) -> tuple[str, str]:
        answer = relay.post(
            token,
            {"command": ["sh", "-c", "sleep 0.2; echo done"]},
            **{"X-Request-Id": f"parallel-{n}"},
        )
        return answer.headers["x-request-id"], answer.json()["id"]

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        pairs = dict(pool.map(submit, range(6)))
    assert set(pairs) == {f"parallel-{n}" for n in range(6)}
    by_run: dict[str, set[str]] = {}
    last = pairs["parallel-5"]
    for line in wait_for(relay, lambda line: line.get("run_id") == last and "route" in line):
        if line.get("run_id") in pairs.values():
            by_run.setdefault(line["run_id"], set()).add(line["request_id"])
    assert by_run == {run_id: {request_id} for request_id, run_id in pairs.items()}


@pytest.mark.slow  # needs a relay process: seconds
def test_a_generated_request_id_is_returned_and_logged(relay: RelayProcess) -> None:
    too_long = "x" * 300
    answer = httpx.get(relay.url + "/v1/jobs", headers={"X-Request-Id": too_long}, timeout=5)
    assert answer.status_code == 401
    request_id = answer.headers["x-request-id"]
    assert request_id.startswith("req_") and answer.json()["error"]["request_id"] == request_id
    found = wait_for(relay, lambda line: line.get("request_id") == request_id)
    [line] = [line for line in found if line.get("request_id") == request_id]
    assert (line["route"], line["status"], line["method"]) == ("/v1/jobs", 401, "GET")
    assert "token" not in line and too_long not in relay.log()


@pytest.mark.slow  # needs a relay process: seconds
@pytest.mark.parametrize(("path", "status"), [("/v1/runs", 401), ("/no/such/route", 404)])
def test_a_websocket_attempt_is_answered_and_logged_as_any_refused_request(
    relay: RelayProcess, path: str, status: int
) -> None:
    """The relay serves no WebSockets: an `Upgrade: websocket` request is the HTTP request
    it is, refused as any other with one access line (uvicorn's WebSocket layer refused it
    with a 403 and two info lines of its own, and no access line)."""
    request_id = f"ws-attempt-{status}"
    before = len(lines(relay))
    with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as sock:
        sock.sendall(
            f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
            "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            f"Sec-WebSocket-Version: 13\r\nX-Request-Id: {request_id}\r\n\r\n".encode()
        )
        answer = b""
        while chunk := sock.recv(65536):  # the relay ends the connection with its answer
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0].startswith(f"HTTP/1.1 {status} ".encode()), head
    assert json.loads(body)["error"]["request_id"] == request_id
    found = wait_for(relay, lambda line: line.get("request_id") == request_id)[before:]
    assert [(line["logger"], line["event"]) for line in found] == [("relay.access", "request")]
    assert (found[0]["method"], found[0]["status"]) == ("GET", status)


def test_console_format_carries_the_same_ids() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.ConsoleFormatter())
    logger = logging.getLogger("relay.test-console")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        context = logs.fresh_context()
        logs.bind(request_id="req_1", token="ops")
        logger.warning("something", extra={"run_id": "run_9", "body": "never shown"})
        logs.restore(context)
        logger.warning("after")
    finally:
        logger.removeHandler(handler)
    first, second = stream.getvalue().splitlines()
    assert first == "warning relay.test-console: something request_id=req_1 run_id=run_9 token=ops"
    assert second == "warning relay.test-console: after"


def test_other_libraries_chatter_is_dropped_and_known_secrets_blanked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        logs.configure("debug", "json")
        logs.redact(["sk-provider-key-1", "tiny"])
        logging.getLogger("httpcore2.http11").debug("headers [(b'Authorization', b'sk-…')]")
        logging.getLogger("some_sdk").warning("the SDK warns")
        logging.getLogger("relay.providers.x").info("oops sk-provider-key-1 was here")
        logging.getLogger("relay.service").debug("a relay debug line")
    finally:
        root.handlers[:], root.level = saved
    written = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [line["event"] for line in written] == [
        "the SDK warns",
        "oops [redacted] was here",
        "a relay debug line",
    ]


def test_a_500_logs_its_stack_without_values(tmp_path: Path) -> None:
    """The unexpected error's class and frames are logged; its message, the frame locals,
    the body and the token are not (the message may quote any of them)."""

    def lookup(body: bytes, token: str) -> None:
        held = {"token": token, "body": body}  # a frame local that must not be logged
        raise KeyError(f"{held} {SECRET_CANARY}")

    async def broken(request: Request) -> Response:
        try:
            lookup(await request.body(), request.headers["authorization"])
        except KeyError as error:
            raise RuntimeError(f"wrapped {SECRET_CANARY}") from error
        return Response()

    settings = make_settings(tmp_path)
    token = new_token(settings.tokens_file, "boom")
    app = create_app(settings)
    app.router.routes.insert(0, Route("/boom", broken, methods=["POST"]))
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter())
    logger = logging.getLogger("relay.app")
    logger.addHandler(handler)
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            answer = client.post(
                "/boom",
                content=b"body-marker-55 " + SECRET_CANARY.encode(),
                headers={"Authorization": f"Bearer {token}"},
            )
    finally:
        logger.removeHandler(handler)
    assert answer.status_code == 500 and answer.json()["error"]["code"] == "internal"
    [line] = [json.loads(raw) for raw in stream.getvalue().splitlines()]
    assert line["event"] == "unhandled error" and line["error_class"] == "RuntimeError"
    stack = line["traceback"]
    assert "builtins.RuntimeError" in stack and "builtins.KeyError" in stack
    assert "in lookup" in stack and "in broken" in stack and "test_logs.py" in stack
    for secret in (SECRET_CANARY, token, "body-marker-55", "Bearer"):
        assert secret not in stream.getvalue(), secret


# The relay's loggers write a plain line (no % arguments, only FIELDS in extra) straight to
# the handler configure() installed; these tests hold that short path to logging's own.

FIXED_TIME = 1_700_000_000.123456  # LogRecord and the short path read time.time()


@pytest.fixture
def configured(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], io.StringIO]]:
    """configure() with the handler's stream swapped for a StringIO; undone after."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level, logs.RelayLogger.sink

    def configure(fmt: str) -> io.StringIO:
        logs.configure("info", fmt)
        stream = io.StringIO()
        handler = root.handlers[0]
        assert isinstance(handler, logging.StreamHandler)
        handler.setStream(stream)
        return stream

    yield configure
    root.handlers[:], level, logs.RelayLogger.sink = saved
    root.setLevel(level)


def count_records(monkeypatch: pytest.MonkeyPatch) -> list[logging.LogRecord]:
    """The records logging builds from here on (the short path builds none)."""
    made: list[logging.LogRecord] = []
    make = logging.Logger.makeRecord

    def counted(self: logging.Logger, *args: Any, **kwargs: Any) -> logging.LogRecord:
        made.append(make(self, *args, **kwargs))
        return made[-1]

    monkeypatch.setattr(logging.Logger, "makeRecord", counted)
    return made


def encode_line(line: dict[str, Any]) -> str:
    """What a JSON line holds for ``line``: ``json.JSONEncoder(default=str)``'s text, with
    each float that is not a number (NaN, an infinity, inside a list too) written null."""

    def finite(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, list):
            return [finite(item) for item in value]
        return value

    return json.JSONEncoder(default=str).encode({key: finite(v) for key, v in line.items()})


def strict_json(raw: str) -> Any:
    """``raw`` parsed as JSON proper: Python's parser takes NaN and Infinity, JSON does not."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(raw, parse_constant=refuse)


class Shown:
    def __str__(self) -> str:
        return "shown ✓"


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_the_short_path_writes_the_line_logging_writes(
    fmt: str,
    configured: Callable[[str], io.StringIO],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    logger = logging.getLogger("relay.test-short")  # made before configure(), as at import
    library = logging.getLogger("some_library.test-short")
    stream = configured(fmt)
    assert isinstance(logger, logs.RelayLogger) and type(library) is logging.Logger
    monkeypatch.setattr(time, "time", lambda: FIXED_TIME)
    logs.redact(["sk-short-path-secret"])
    extras: list[dict[str, Any] | None] = [
        None,
        {"run_id": "run_x", "state": "succeeded"},
        {"status": 200, "duration_ms": 1.25, "method": "POST", "route": "/v1/runs"},
        {"job": 'quo"te\\ \n tab\t é ☃ \x00', "attempt": True, "status": float("nan")},
        {"token": None, "error_code": Shown(), "path": ["a", {"b": 1}], "state": 2**70},
        {"error_class": "key sk-short-path-secret leaked", "duration_ms": 10.0},
    ]
    made = count_records(monkeypatch)
    context = logs.fresh_context()
    try:
        logs.bind(request_id="req_1", run_id="run_bound", token="ops", provider="memory")
        for extra in extras:
            logger.info("run finished", extra=extra)
            logger.warning("a warning ü", extra=extra)
        assert made == []  # every line took the short path
        short = stream.getvalue()
        stream.seek(0)
        stream.truncate()
        logger.addFilter(lambda record: True)  # any logger filter: logging's own path
        for extra in extras:
            logger.info("run finished", extra=extra)
            logger.warning("a warning ü", extra=extra)
        assert len(made) == 2 * len(extras)
    finally:
        logs.restore(context)
        logger.filters.clear()
    assert short == stream.getvalue()
    if fmt == "json":  # and both are what json.JSONEncoder(default=str) makes of the dict
        encode = encode_line
        bound = {"request_id": "req_1", "run_id": "run_bound", "token": "ops"}
        for raw, extra in zip(short.splitlines()[::2], extras, strict=True):
            own = {k: v for k, v in (extra or {}).items() if v is not None}
            line = {"ts": "2023-11-14T22:13:20.123Z", "level": "info"}
            line |= {"logger": "relay.test-short", "event": "run finished"}
            fields = {**bound, "provider": "memory", **own}
            line |= {key: fields[key] for key in logs.FIELDS if key in fields}
            assert raw == encode(line).replace("sk-short-path-secret", logs.REDACTED)
    assert "sk-short-path-secret" not in short and logs.REDACTED in short


@pytest.mark.parametrize(
    ("fmt", "encoding", "errors"),
    [
        ("json", "utf-8", "strict"),
        ("console", "utf-8", "strict"),
        ("console", "ascii", "backslashreplace"),
    ],
)
def test_a_line_written_to_the_files_descriptor_is_what_the_stream_writes_in_its_place(
    fmt: str,
    encoding: str,
    errors: str,
    configured: Callable[[str], io.StringIO],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """On a text file (stderr, a log file) the short path writes a line's bytes to the file
    descriptor itself: the same bytes the stream's text and buffer layers write on
    logging's own path (a secret blanked, non-ASCII text, NaN, the stream's own encoding and
    error handler), after whatever another writer left in the stream's buffer."""
    logger = logging.getLogger("relay.test-descriptor")
    configured(fmt)
    handler = logging.getLogger().handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    path = tmp_path / "relay.log"
    stream = path.open("w", encoding=encoding, errors=errors)  # block-buffered
    file = stream.fileno()
    handler.setStream(stream)
    monkeypatch.setattr(time, "time", lambda: FIXED_TIME)
    logs.redact(["sk-descriptor-secret"])
    written: list[int] = []
    write = os.write

    def counted(file: int, data: bytes) -> int:
        written.append(file)
        return write(file, data)

    monkeypatch.setattr(os, "write", counted)
    extras: list[dict[str, Any]] = [
        {"run_id": "run_x", "state": "succeeded"},
        {"job": 'quo"te é ☃ \x00', "status": float("nan"), "duration_ms": 1.5},
        {"error_class": "key sk-descriptor-secret leaked", "attempt": 2},
    ]
    context = logs.fresh_context()
    try:
        logs.bind(request_id="req_é", token="ops")
        for path_taken in ("short", "general"):
            stream.write(f"{path_taken} round, not a line yet: ")  # left in the buffer
            for extra in extras:
                logger.info("run finished ü", extra=extra)
            stream.write("\n")
            logger.addFilter(lambda record: True)  # the second round: logging's own path
    finally:
        logs.restore(context)
        logger.filters.clear()
        stream.close()
    assert written == [file] * len(extras)  # the short path's lines, each in one write
    short, general = path.read_bytes().split(b"general round, not a line yet: ")
    assert short.startswith(b"short round, not a line yet: ")
    assert short.removeprefix(b"short round, not a line yet: ") == general
    assert b"sk-descriptor-secret" not in general and logs.REDACTED.encode() in general
    assert len(general.splitlines()) == len(extras) + 1


class BareWriter:
    """A stream as little as logging needs: ``write`` and ``flush``, no ``encoding`` or
    ``errors`` (a tee or a shipper's wrapper put in place of stderr)."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def write(self, text: str) -> None:
        self.parts.append(text)

    def flush(self) -> None:
        pass


def test_every_line_reaches_a_stream_that_has_no_encoding_attribute(
    configured: Callable[[str], io.StringIO],
) -> None:
    """The short path looked at the stream's ``encoding`` to tell whether it changed since
    the last line: on a stream without one, every line after the first was lost to
    ``handleError`` (a traceback on stderr instead of the line)."""
    logger = logging.getLogger("relay.test-bare-writer")
    configured("json")
    handler = logging.getLogger().handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    writer = BareWriter()
    handler.setStream(writer)  # type: ignore[arg-type]
    for attempt in range(3):
        logger.info("line", extra={"attempt": attempt})
    lines = [strict_json(raw) for raw in "".join(writer.parts).splitlines()]
    assert [line["attempt"] for line in lines] == [0, 1, 2]


@pytest.mark.parametrize("opener", [gzip.open, bz2.open, lzma.open], ids=["gzip", "bz2", "lzma"])
def test_lines_to_a_compressing_text_stream_are_compressed_with_the_rest(
    opener: Callable[..., IO[str]], configured: Callable[[str], io.StringIO], tmp_path: Path
) -> None:
    """``gzip.open(path, "wt")`` (bz2's, lzma's) is a plain ``TextIOWrapper`` whose
    ``fileno()`` is the compressed file's: the short path wrote each line's text straight
    into it, and the file no longer decompressed. Only a text layer over a buffered file
    on a descriptor of its own (stderr, ``open``) may be written past."""
    logger = logging.getLogger("relay.test-compressed")
    configured("json")
    handler = logging.getLogger().handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    path = tmp_path / "relay.log.z"
    with opener(path, "wt") as stream:
        handler.setStream(stream)
        stream.write("before\n")
        logger.info("one")
        logger.info("two")
    with opener(path, "rt") as written:
        lines = written.read().splitlines()
    assert lines[0] == "before"
    assert [strict_json(raw)["event"] for raw in lines[1:]] == ["one", "two"]


def test_a_stream_reconfigured_after_a_line_writes_the_next_as_it_now_would(
    configured: Callable[[str], io.StringIO], tmp_path: Path
) -> None:
    logger = logging.getLogger("relay.test-reconfigured")
    configured("console")
    handler = logging.getLogger().handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    path = tmp_path / "relay.log"
    with path.open("w", encoding="ascii", errors="backslashreplace") as stream:
        handler.setStream(stream)
        logger.info("café")
        stream.reconfigure(errors="replace")
        logger.info("café")
    assert path.read_text().splitlines() == [
        "info    relay.test-reconfigured: caf\\xe9",
        "info    relay.test-reconfigured: caf?",
    ]


_TEXT = st.text(
    st.characters(exclude_categories=("Cs",)) | st.sampled_from('"\\\u2028\x00\x1f\x7fé☃'),
    max_size=6,
)
_EQUAL_NOT_ALIKE = st.sampled_from([0, 0.0, -0.0, False, 1, 1.0, True, "1", "a"])  # 1 == 1.0
_VALUE = (
    st.none() | _EQUAL_NOT_ALIKE | _TEXT | st.integers() | st.floats() | st.lists(_TEXT, max_size=2)
)
_FIELDS = st.dictionaries(st.sampled_from(logs.FIELDS), _VALUE, max_size=6)


@hypothesis.settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture],  # reset below
)
@hypothesis.given(binds=st.lists(_FIELDS, min_size=1, max_size=3), extras=st.lists(_FIELDS))
def test_a_lines_own_fields_win_over_the_bound_ones_on_either_path(
    binds: list[dict[str, Any]],
    extras: list[dict[str, Any]],
    configured: Callable[[str], io.StringIO],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The short path keeps the bound ids' text with them and looks only at a line's own
    keys; logging's path gives it the record. Both write, for any ids bound one after
    another and any extras (the very objects bound among them), what the encoder writes
    of the line's dict: its own non-None values over the bound ones, in FIELDS order."""
    logger = logging.getLogger("relay.test-property")
    stream = configured("json")
    monkeypatch.setattr(time, "time", lambda: FIXED_TIME)
    encode = encode_line

    def written() -> tuple[str, list[str]]:
        expected: list[str] = []
        context = logs.fresh_context()
        try:
            bound: dict[str, Any] = {}
            for fields in binds:
                logs.bind(**fields)
                bound |= {key: value for key, value in fields.items() if value is not None}
                for extra in [*extras, dict(bound)]:  # the bound objects themselves too
                    logger.info("line", extra=extra)
                    own = {key: value for key, value in extra.items() if value is not None}
                    line = {"ts": "2023-11-14T22:13:20.123Z", "level": "info"}
                    line |= {"logger": "relay.test-property", "event": "line"}
                    mine = bound | own
                    line |= {key: mine[key] for key in logs.FIELDS if key in mine}
                    expected.append(encode(line))
        finally:
            logs.restore(context)
        text = stream.getvalue()
        stream.seek(0)
        stream.truncate()
        return text, expected

    short, expected = written()
    logger.addFilter(lambda record: True)  # any logger filter: logging's own path
    try:
        general, _ = written()
    finally:
        logger.filters.clear()
    assert short.splitlines() == expected
    assert general == short
    for raw in expected:
        strict_json(raw)


def test_a_float_that_is_not_a_number_is_written_null_and_the_line_stays_json(
    configured: Callable[[str], io.StringIO], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python's encoder writes NaN and the infinities as bare words no JSON parser takes: a
    log pipeline would drop the line. Bound or the line's own, alone or in a list, on the
    short path and on logging's own, they are written null."""
    logger = logging.getLogger("relay.test-nan")
    stream = configured("json")
    monkeypatch.setattr(time, "time", lambda: FIXED_TIME)
    context = logs.fresh_context()
    try:
        logs.bind(attempt=float("inf"), token="ops")
        for _ in ("short", "general"):
            logger.info("nan", extra={"duration_ms": float("nan"), "status": -float("inf")})
            logger.info("nested", extra={"path": [1.5, float("nan"), "x"], "state": 2.5})
            logger.addFilter(lambda record: True)  # the second round: logging's own path
    finally:
        logs.restore(context)
        logger.filters.clear()
    raws = stream.getvalue().splitlines()
    assert raws[:2] == raws[2:]
    first, second = (strict_json(raw) for raw in raws[:2])
    assert (first["duration_ms"], first["status"], first["attempt"]) == (None, None, None)
    assert (second["path"], second["state"], second["attempt"]) == ([1.5, None, "x"], 2.5, None)
    assert raws[0].endswith('"status": null, "duration_ms": null, "attempt": null}')


def test_a_field_whose_dict_has_a_nan_or_infinite_key_is_still_written_as_a_json_line(
    configured: Callable[[str], io.StringIO], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A float key is a string in JSON: the encoder wrote a NaN or infinite one as the key
    ``"NaN"`` / ``"Infinity"`` (valid JSON). Refusing non-finite floats must not refuse such
    a key too: the line was lost to ``handleError`` instead (a traceback on stderr)."""
    logger = logging.getLogger("relay.test-nan-key")
    stream = configured("json")
    monkeypatch.setattr(time, "time", lambda: FIXED_TIME)
    for _ in ("short", "general"):
        logger.info("keys", extra={"status": {float("nan"): 1, -float("inf"): float("inf")}})
        logger.addFilter(lambda record: True)  # the second round: logging's own path
    logger.filters.clear()
    raws = stream.getvalue().splitlines()
    assert len(raws) == 2 and raws[0] == raws[1]
    assert strict_json(raws[0])["status"] == {"NaN": 1, "-Infinity": None}


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_a_field_holding_an_int_too_long_to_write_keeps_its_line(
    configured: Callable[[str], io.StringIO], monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    """Python writes no int past 4300 digits (``ValueError``): a line with one, bound or its
    own, alone, in a list or as a dict key, was lost to ``handleError``. It is written, the
    number as a marker of its size."""
    logger = logging.getLogger("relay.test-long-int")
    stream = configured(fmt)
    monkeypatch.setattr(time, "time", lambda: FIXED_TIME)
    huge = 10**5000
    context = logs.fresh_context()
    try:
        logs.bind(attempt=-huge, token="ops")
        for _ in ("short", "general"):
            logger.info("long", extra={"status": huge, "path": [1, huge], "job": {huge: 2}})
            logger.addFilter(lambda record: True)  # the second round: logging's own path
    finally:
        logs.restore(context)
        logger.filters.clear()
    raws = stream.getvalue().splitlines()
    assert len(raws) == 2 and raws[0] == raws[1], raws
    marker = "<an integer of about 5001 digits>"
    if fmt == "console":
        assert f"status={marker}" in raws[0] and f"path=[1, '{marker}']" in raws[0]
        assert "attempt=<an integer" in raws[0] and "token=ops" in raws[0]
        return
    line = strict_json(raws[0])
    assert (line["status"], line["path"], line["job"]) == (marker, [1, marker], {marker: 2})
    assert (line["attempt"], line["token"]) == (marker, "ops")


def test_a_line_is_the_same_once_its_head_is_kept_and_after_the_kept_heads_start_over(
    configured: Callable[[str], io.StringIO], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The JSON formatter keeps each (level, logger, event)'s text; a line of a kept head,
    and one written after so many others that they were dropped, are what the encoder
    writes."""
    logger = logging.getLogger("relay.test-heads")
    stream = configured("json")
    monkeypatch.setattr(time, "time", lambda: FIXED_TIME)
    events = ["run finished", 'quo"te é', *(f"event {n}" for n in range(600)), "run finished"]
    for event in events:
        logger.info(event)
        logger.warning(event)
    expected = [
        encode_line(
            {"ts": "2023-11-14T22:13:20.123Z", "level": level, "logger": "relay.test-heads"}
            | {"event": event}
        )
        for event in events
        for level in ("info", "warning")
    ]
    assert stream.getvalue().splitlines() == expected


def test_a_bound_value_that_can_change_is_written_as_it_is_at_each_line(
    configured: Callable[[str], io.StringIO],
) -> None:
    logger = logging.getLogger("relay.test-mutable")
    stream = configured("json")
    path = ["a"]
    context = logs.fresh_context()
    try:
        logs.bind(path=path, token="ops")
        logger.info("first")
        path.append("b")
        logger.info("second")
        logs.bind(token="other")
        logger.info("third")
    finally:
        logs.restore(context)
    lines = [json.loads(raw) for raw in stream.getvalue().splitlines()]
    assert [(line["path"], line["token"]) for line in lines] == [
        (["a"], "ops"),
        (["a", "b"], "ops"),
        (["a", "b"], "other"),
    ]


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_another_handler_or_logger_setting_takes_loggings_own_path(
    configured: Callable[[str], io.StringIO], monkeypatch: pytest.MonkeyPatch
) -> None:
    logger = logging.getLogger("relay.test-other")
    stream = configured("json")
    made = count_records(monkeypatch)
    capture = Capture()
    root = logging.getLogger()
    root.addHandler(capture)  # as pytest's caplog does
    logger.info("seen twice", extra={"run_id": "run_1"})
    root.removeHandler(capture)
    assert [record.__dict__["run_id"] for record in capture.records] == ["run_1"]
    assert json.loads(stream.getvalue())["event"] == "seen twice"
    assert len(made) == 1
    parent = logging.getLogger("relay")
    parent.propagate = False
    try:
        logger.info("stops at relay")
    finally:
        parent.propagate = True
    logger.info("not a field", extra={"body": "never shown"})
    logger.info("%s args", "with")
    assert len(made) == 4
    written = [json.loads(raw) for raw in stream.getvalue().splitlines()]
    assert [line["event"] for line in written] == ["seen twice", "not a field", "with args"]
    assert "never shown" not in stream.getvalue()


def test_levels_disable_and_the_own_lines_filter_hold_on_the_short_path(
    configured: Callable[[str], io.StringIO],
) -> None:
    logger = logging.getLogger("relay.test-levels")
    stream = configured("json")
    handler = logging.getLogger().handlers[0]
    logger.debug("below the root's level")
    logging.disable(logging.INFO)
    try:
        logger.info("disabled")
        logger.warning("kept 1")
    finally:
        logging.disable(logging.NOTSET)
    handler.setLevel(logging.WARNING)
    logger.info("below the handler's level")
    handler.setLevel(logging.NOTSET)
    other = logs.RelayLogger("sdk.chatty")  # not one of OWN_LOGGERS
    other.parent = logging.getLogger()
    other.info("dropped by OwnLinesFilter")
    other.warning("kept 2")
    logger.info("kept 3")
    written = [json.loads(raw)["event"] for raw in stream.getvalue().splitlines()]
    assert written == ["kept 1", "kept 2", "kept 3"]


class FullDisk(io.StringIO):
    def write(self, text: str) -> int:
        raise OSError(28, "No space left on device")


def test_a_failing_write_is_reported_not_raised(
    configured: Callable[[str], io.StringIO], capsys: pytest.CaptureFixture[str]
) -> None:
    logger = logging.getLogger("relay.test-full")
    configured("json")
    handler = logging.getLogger().handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(FullDisk())
    logger.info("lost line", extra={"run_id": "run_1"})  # must not raise
    err = capsys.readouterr().err
    assert "--- Logging error ---" in err and "No space left on device" in err
    assert "Message: 'lost line'" in err


def test_the_short_path_writes_under_the_handlers_lock(
    configured: Callable[[str], io.StringIO],
) -> None:
    logger = logging.getLogger("relay.test-lock")
    stream = configured("json")
    handler = logging.getLogger().handlers[0]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        handler.acquire()
        try:
            pending = pool.submit(logger.info, "waits for the lock")
            time.sleep(0.05)
            assert stream.getvalue() == "" and not pending.done()
        finally:
            handler.release()
        pending.result(timeout=5)
    assert json.loads(stream.getvalue())["event"] == "waits for the lock"


def test_a_line_on_loggings_own_path_keeps_its_callers_place(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    logger = logging.getLogger("relay.test-caller")
    logger.__class__ = logs.RelayLogger  # as configure() makes it
    monkeypatch.setattr(logging, "_srcfile", logging.__file__)  # caller lookup on
    with caplog.at_level(logging.INFO):
        logger.info("from here")
        logger.warning("and here")
    for record in caplog.records:
        assert (record.filename, record.funcName) == (
            "test_logs.py",
            "test_a_line_on_loggings_own_path_keeps_its_callers_place",
        )


_CRASH_AFTER_A_LINE = """
import logging, os, sys
from relay import logs
log = logging.getLogger("relay.test-crash")  # made at import, as the relay's are
if sys.argv[1] == "block-buffered":
    sys.stderr.reconfigure(line_buffering=False)
logs.configure("info", "json")
assert isinstance(log, logs.RelayLogger)  # the short path writes the line
log.info("written before the crash")
os._exit(3)  # no flush at exit, as a killed relay gets none
"""


@pytest.mark.parametrize("stderr", ["line-buffered", "unbuffered", "block-buffered"])
def test_a_line_is_in_the_file_before_the_relay_moves_on(tmp_path: Path, stderr: str) -> None:
    """A relay that dies right after a line (killed, no exit handlers) has written it, on
    stderr as Python makes it (line-buffered), as the image runs the relay (unbuffered) and
    on a stream that keeps what it is given until flushed: the short path flushes each
    line as logging's handler does."""
    log = tmp_path / "stderr.log"
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}
    if stderr == "unbuffered":
        env["PYTHONUNBUFFERED"] = "1"
    with log.open("w") as file:
        done = subprocess.run(
            [sys.executable, "-c", _CRASH_AFTER_A_LINE, stderr],
            stderr=file,
            env=env,
            timeout=60,
            check=False,
        )
    assert done.returncode == 3
    [line] = [json.loads(raw) for raw in log.read_text().splitlines()]
    assert line["event"] == "written before the crash"


def test_a_secret_with_a_quote_a_backslash_or_an_accent_is_blanked_in_json_lines_too(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A JSON line escapes those characters, so the value as it is never appears in it."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    secret = 'pa"ss\\wörd-42'
    try:
        logs.configure("info", "json")
        logs.redact([secret])
        logging.getLogger("relay.providers.x").info(f"the SDK said {secret} once")
        logging.getLogger("relay.providers.x").info("bound", extra={"job": secret})
    finally:
        root.handlers[:], root.level = saved
    text = capsys.readouterr().err
    untimed = re.sub(r'"ts": "[^"]*"', "", text)  # a time at minute 42 has a "42"
    assert "42" not in untimed.replace("[redacted]", ""), text
    written = [json.loads(line) for line in text.splitlines()]
    assert written[0]["event"] == "the SDK said [redacted] once"
    assert written[1]["job"] == "[redacted]"


def test_a_line_to_a_pipe_that_would_block_is_kept_whole_for_the_next_write(
    configured: Callable[[str], io.StringIO],
) -> None:
    """stderr a pipe another process made non-blocking (its reader slow: a log shipper, a
    terminal multiplexer): a line the pipe takes only part of keeps the rest in the stream's
    buffer, as the stream writes it, and goes out before the next line. No line is cut, and
    none is glued to the next."""
    logger = logging.getLogger("relay.test-nonblocking")
    configured("json")
    handler = logging.getLogger().handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    os.set_blocking(read_end, False)
    stream = open(write_end, "w", encoding="utf-8")  # noqa: SIM115 - closed below
    handler.setStream(stream)
    try:
        filled = 0
        while filled < 1 << 22:  # the pipe full (64 KiB on Linux), bounded anyway
            try:
                filled += os.write(write_end, b"f" * 4096)
            except BlockingIOError:
                break
        got = bytearray(os.read(read_end, 4096))  # room for one page: less than the line

        def drain() -> None:
            with contextlib.suppress(BlockingIOError):
                while chunk := os.read(read_end, 65536):
                    got.extend(chunk)

        logger.info("long line", extra={"job": "x" * 6000})  # taken only in part
        drain()
        logger.info("next line", extra={"run_id": "run_next"})
        drain()
    finally:
        stream.close()
        os.close(read_end)
    written = bytes(got).lstrip(b"f").splitlines()
    assert [json.loads(line)["event"] for line in written] == ["long line", "next line"]
