"""Request ids (relay/http/app.py ``RequestIds``): drawn from the OS's random source a pool at
a time, each one taken once, in this process and in a forked child."""

from __future__ import annotations

import asyncio
import os
import re
import warnings
from pathlib import Path

import pytest
from starlette.types import Message

from relay.auth import new_token
from relay.http.app import REQUEST_IDS, RequestIds, create_app
from tests.conftest import make_settings


def test_request_ids_are_req_and_16_hex_digits_and_never_repeat_across_pools() -> None:
    ids = RequestIds()
    per_pool = RequestIds.POOL_BYTES // 8
    taken = [ids.new() for _ in range(per_pool * 3 + 5)]
    assert all(re.fullmatch(r"req_[0-9a-f]{16}", each) for each in taken)
    assert len(set(taken)) == len(taken)


def test_a_forked_child_draws_request_ids_its_parent_does_not_take() -> None:
    REQUEST_IDS.new()  # the pool holds ids the parent will take next
    reading, writing = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12 warns of fork() in a process with threads; the child only writes a pipe.
        warnings.simplefilter("ignore", DeprecationWarning)
        child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        os.write(writing, REQUEST_IDS.new().encode())
        os._exit(0)
    os.close(writing)
    _, status = os.waitpid(child, 0)
    childs = os.read(reading, 64).decode()
    os.close(reading)
    assert status == 0 and re.fullmatch(r"req_[0-9a-f]{16}", childs)
    parents = [REQUEST_IDS.new() for _ in range(RequestIds.POOL_BYTES // 8)]
    assert childs not in parents


@pytest.mark.parametrize(
    ("sent", "kept"),
    [
        (b"abc-123", True),
        (b"x" * 128, True),
        (b"x" * 129, False),
        (b"", False),
        (b"a\x7fb", False),  # not printable
        # Not ASCII: it was kept, decoded as Latin-1, and sent back encoded as UTF-8 (sent
        # "caf\xe9", answered "caf\xc3\xa9"): the caller's own id did not come back.
        (b"caf\xe9", False),
        (None, False),
    ],
    ids=["short", "128 characters", "129 characters", "empty", "unprintable", "not ascii", "none"],
)
def test_a_request_s_own_id_is_kept_only_if_it_is_1_to_128_printable_ascii_characters(
    tmp_path: Path, sent: bytes | None, kept: bool
) -> None:
    settings = make_settings(tmp_path)
    new_token(settings.tokens_file, "ops")
    app = create_app(settings)
    headers = [] if sent is None else [(b"x-request-id", sent)]
    answers: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        answers.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/no-such-route",
        "raw_path": b"/no-such-route",
        "root_path": "",
        "query_string": b"",
        "headers": headers,
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
    }
    asyncio.run(app(scope, receive, send))
    [answered] = [value for name, value in answers[0]["headers"] if name == b"x-request-id"]
    if kept:
        assert answered == sent
    else:
        assert re.fullmatch(rb"req_[0-9a-f]{16}", answered)
