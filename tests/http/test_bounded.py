"""Bounded under load (issue 19): a listing's memory follows its ``limit``, slow and idle
clients are dropped while ``/healthz`` answers, and event streams per token are capped."""

from __future__ import annotations

import asyncio
import contextlib
import resource
import selectors
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from relay.store import schema
from relay.store.database import Store
from relay.store.schema import runs
from testing.relay_server import RelayProcess
from testing.rows import run_row

OUTPUT = "x" * (1 << 20)


def _kib(pid: int, field: str) -> int:
    """A ``/proc/PID/status`` figure (VmRSS, VmHWM) in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field}")


async def _write_runs(url: str, count: int) -> None:
    store = await Store.open(url)
    try:
        for number in range(count):
            row = run_row(f"run_big{number:03}", state="succeeded", stdout=OUTPUT, stderr=OUTPUT)
            await store.admit_run(row)
    finally:
        await store.close()


@pytest.fixture
def big_runs(tmp_path: Path) -> Iterator[RelayProcess]:
    relay = RelayProcess(tmp_path, max_output_bytes=1 << 20)
    relay.add_token("ops", command=True)
    asyncio.run(_write_runs(relay.env["RELAY_DATABASE_URL"], 40))
    relay.start()
    yield relay
    relay.stop()


@pytest.mark.slow  # needs a relay process: seconds
def test_a_listing_reads_no_output_and_its_memory_follows_the_limit(
    big_runs: RelayProcess,
) -> None:
    token = big_runs.tokens["ops"]
    assert big_runs.process is not None
    pid = big_runs.process.pid
    assert big_runs.get(token, "/v1/runs", limit=1).status_code == 200  # warm
    before = _kib(pid, "VmRSS")
    listing = big_runs.get(token, "/v1/runs", limit=200)
    grown_mib = (_kib(pid, "VmHWM") - before) / 1024
    # 80 MiB of output stored: on the old code the page held all of it, several times.
    assert grown_mib < 16, f"the relay grew {grown_mib:.0f} MiB for one listing"
    runs = listing.json()["runs"]
    assert listing.status_code == 200 and len(runs) == 40
    assert all("stdout" not in run and "stderr" not in run for run in runs)
    assert {(run["stdout_bytes"], run["stderr_bytes"]) for run in runs} == {(1 << 20, 1 << 20)}
    assert len(listing.content) < 40 * 2048
    one = big_runs.get(token, f"/v1/runs/{runs[0]['id']}").json()
    assert len(one["stdout"]) == 1 << 20 and len(one["stderr"]) == 1 << 20


HELD = 3000
HEADER_TIMEOUT_S = 3.0


def _allow_files(count: int) -> None:
    """This test process must be able to hold ``count`` sockets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < count:
        assert hard >= count, f"the hard open-file limit {hard} is below {count}"
        resource.setrlimit(resource.RLIMIT_NOFILE, (count, hard))


@pytest.mark.slow  # needs a relay process: seconds
def test_half_sent_requests_are_dropped_and_healthz_still_answers(tmp_path: Path) -> None:
    _allow_files(HELD + 256)
    relay = RelayProcess(
        tmp_path,
        header_timeout_s=HEADER_TIMEOUT_S,
        body_timeout_s=1,
        keep_alive_s=1,
        max_connections=1000,
    )
    token = relay.add_token("ops", command=True)
    # Fewer files than held connections: on its own, the kernel limit would stop accept().
    relay.start(open_files=2048)
    held: list[socket.socket] = []
    try:
        for _ in range(HELD):
            sock = socket.create_connection(("127.0.0.1", relay.port), timeout=5)
            sock.sendall(b"GET /v1/runs HTTP/1.1\r\nHost: x\r\n")  # headers never end
            held.append(sock)
        opened = time.monotonic()
        stalled = socket.create_connection(("127.0.0.1", relay.port), timeout=5)
        head = f"POST /v1/runs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
        stalled.sendall(head.encode() + b"Content-Length: 9\r\n\r\n{")
        held.append(stalled)  # headers in, body never
        idle = socket.create_connection(("127.0.0.1", relay.port), timeout=5)
        idle.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert idle.recv(4096).startswith(b"HTTP/1.1 200")
        held.append(idle)  # kept alive, then silent
        for _ in range(3):
            started = time.monotonic()
            answer = httpx.get(relay.url + "/healthz", timeout=1)
            assert answer.status_code == 200 and time.monotonic() - started < 1
        assert time.monotonic() - opened < HEADER_TIMEOUT_S, "too slow to test while held"
        open_left = set(held)
        with selectors.DefaultSelector() as selector:
            for sock in held:
                sock.setblocking(False)
                selector.register(sock, selectors.EVENT_READ)
            deadline = opened + HEADER_TIMEOUT_S + 3
            while open_left and time.monotonic() < deadline:
                for key, _ in selector.select(timeout=0.2):
                    ready = key.fileobj
                    assert isinstance(ready, socket.socket)
                    sock = ready
                    with contextlib.suppress(ConnectionError):
                        if sock.recv(4096):
                            continue  # an answer (there should be none) before the close
                    selector.unregister(sock)
                    open_left.discard(sock)
        assert not open_left, f"{len(open_left)} half-sent connections still open"
        assert relay.get(None, "/healthz").status_code == 200
    finally:
        for sock in held:
            sock.close()
        relay.stop()
    assert "unhandled error" not in relay.log()  # a body that never came is no relay error
    assert '"status": 408' in relay.log()


async def test_output_sizes_are_kept_with_the_output_and_filled_in_by_the_migration(
    database_url: str,
) -> None:
    store = await Store.open(database_url)
    try:
        await store.admit_run(run_row("run_sized", stdout="é\n"))
        await store.update_run("run_sized", state="succeeded", stderr="x" * 10)
        await store.admit_run(run_row("run_quiet"))
        listed, _ = await store.list_runs("ops", state=None, job=None, limit=10, cursor=None)
        sizes = {row.id: (row.stdout_bytes, row.stderr_bytes) for row in listed}
        assert sizes == {"run_sized": (3, 10), "run_quiet": (0, 0)}
        assert all(row.stdout == "" and row.stderr == "" for row in listed)  # not read

        def forget(conn: sa.Connection) -> None:  # as a relay before version 7 left them
            conn.execute(runs.update().values(stdout_bytes=None, stderr_bytes=None))

        await store.write(forget)
        listed, _ = await store.list_runs("ops", state=None, job=None, limit=10, cursor=None)
        assert {row.id: row.stdout_bytes for row in listed}["run_sized"] == 3  # measured
        await store.write(schema.MIGRATIONS[7])
        stored = await store.read(
            lambda conn: conn.execute(sa.select(runs.c.id, runs.c.stdout_bytes)).all()
        )
        assert dict(stored) == {"run_sized": 3, "run_quiet": 0}
    finally:
        await store.close()
