"""The throwaway PostgreSQL of testing/postgres.py: it starts, answers, and is gone afterwards."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import pytest

from testing import postgres
from testing.postgres import start_postgres, temp_base
from testing.settings import REPO

pytestmark = pytest.mark.postgres

URL_PATTERN = re.compile(r"^postgresql\+asyncpg://[\w-]+@127\.0\.0\.1:\d+/\w+$")


def _dsn(url: str) -> str:
    """asyncpg speaks plain ``postgresql://``; SQLAlchemy's driver suffix goes."""
    return url.replace("postgresql+asyncpg://", "postgresql://", 1)


async def test_select_one(postgres_url: str) -> None:
    connection = await asyncpg.connect(_dsn(postgres_url), timeout=10)
    try:
        assert await connection.fetchval("select 1") == 1
        database = urlsplit(postgres_url).path.lstrip("/")
        assert await connection.fetchval("select current_database()") == database
    finally:
        await connection.close()


def test_url_is_loopback_asyncpg(postgres_url: str) -> None:
    if "RELAY_TEST_POSTGRES_URL" not in os.environ:
        assert URL_PATTERN.match(postgres_url), postgres_url


def _server_dirs() -> set[Path]:
    return set(temp_base().glob("relay-pg-*"))


async def test_own_server_stops_and_leaves_nothing() -> None:
    """A second, private server: reachable inside the block, gone (port and files) after."""
    if "RELAY_TEST_POSTGRES_URL" in os.environ:
        pytest.skip("RELAY_TEST_POSTGRES_URL is set: no server of our own is started")
    before = _server_dirs()
    with start_postgres() as url:
        port = urlsplit(url).port
        assert port is not None
        # Its own: other test processes (pytest -n) start and stop servers meanwhile.
        [root] = [
            d for d in _server_dirs() - before if (d / "sockets" / f".s.PGSQL.{port}").exists()
        ]
        connection = await asyncpg.connect(_dsn(url), timeout=10)
        try:
            assert await connection.fetchval("select 1 + 1") == 2
        finally:
            await connection.close()
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0, "server still listening after exit"
    assert not root.exists(), "data directory left behind"


def test_without_server_and_root_it_skips_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    from testing import postgres

    monkeypatch.delenv("RELAY_TEST_POSTGRES_URL", raising=False)
    monkeypatch.delenv("RELAY_TEST_REQUIRE_POSTGRES", raising=False)
    monkeypatch.setattr(postgres, "find_server", lambda: None)
    monkeypatch.setattr(postgres, "_is_root", lambda: False)
    skipped = pytest.raises(pytest.skip.Exception, match=r"no server binaries .* and not root")
    with skipped, start_postgres():
        pytest.fail("yielded a URL without a server")


def test_required_postgres_fails_instead_of_skipping(monkeypatch: pytest.MonkeyPatch) -> None:
    from testing import postgres

    monkeypatch.delenv("RELAY_TEST_POSTGRES_URL", raising=False)
    monkeypatch.setenv("RELAY_TEST_REQUIRE_POSTGRES", "1")
    monkeypatch.setattr(postgres, "find_server", lambda: None)
    monkeypatch.setattr(postgres, "_is_root", lambda: False)
    failed = pytest.raises(pytest.fail.Exception, match=r"RELAY_TEST_REQUIRE_POSTGRES=1")
    with failed, start_postgres():
        pytest.fail("yielded a URL without a server")


A_RUN = """
import os, signal, sys
from testing.postgres import own_postgres
with own_postgres() as (_, url):
    print(url, flush=True)
    if sys.argv[1] == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.stdin.read()  # a live run: until the test lets it go
"""


def _listening(url: str) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", urlsplit(url).port or 0)) == 0


@pytest.mark.slow  # starts three servers, two in processes of their own
def test_a_killed_runs_server_is_stopped_by_the_next_start_and_a_live_runs_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server is a daemon: a test process killed outright left it running (memory,
    200 connections' worth of shared state, a port) with its folder, run after run."""
    if "RELAY_TEST_POSTGRES_URL" in os.environ:
        pytest.skip("RELAY_TEST_POSTGRES_URL is set: no server of our own is started")
    argv = [sys.executable, "-c", A_RUN]
    killed = subprocess.run(
        [*argv, "killed"], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert killed.returncode == -9, killed.stderr
    left = killed.stdout.strip()
    assert _listening(left)  # what the killed run left
    [left_root] = [
        d for d in _server_dirs() if (d / "sockets" / f".s.PGSQL.{urlsplit(left).port}").exists()
    ]
    live = subprocess.Popen(
        [*argv, "live"], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert live.stdin is not None and live.stdout is not None
    try:
        other = live.stdout.readline().strip()  # another run's, beside this one
        monkeypatch.setattr(
            postgres, "_swept", [], raising=False
        )  # as in a process starting its first
        with start_postgres() as url:
            assert _listening(url) and _listening(other)
            assert not _listening(left) and not left_root.exists()
    finally:
        live.stdin.close()
        assert live.wait(60) == 0
        live.stdout.close()
    assert not _listening(other)
