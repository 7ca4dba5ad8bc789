"""``relay probe``: one dated line with the timings; exit 0 when the provider works, 2 and
``error: …`` when it does not, without a word of what the provider answered."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from relay.cli.probe import _probe
from relay.providers.probe import run_probe
from relay.runs.breakers import Breakers
from relay.store.database import Store
from relay.store.limits import day_start
from relay.store.pools import CLAIMED, ENDED, READY, PoolRecord, PoolRows, PoolSummary, read_summary
from relay.store.quiet_reads import read_breakers
from relay.store.schema import replicas
from testing.rigs import ON_FAKES, RIGS
from tests.conftest import make_settings

CANARY = "probe-canary-c4f2"
LINE = re.compile(
    r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ probe (?P<provider>\S+) (?P<verdict>ok|failed at \w+)"
    r"(?P<timings>( (create|exec|terminate)=\d+ms)*)( sandbox=\S+)?"
    r"(( \w+=\S+)* limits=(?P<limits>\S+))?$"
)


def probe(
    provider: str, tmp_path: Path, *flags: str, **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relay", "probe", provider, *flags],
        cwd=tmp_path,
        env={"PATH": os.environ["PATH"], "HOME": str(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.slow  # runs the relay CLI in a subprocess: seconds
def test_local_probe_prints_one_dated_line_and_leaves_nothing(tmp_path: Path) -> None:
    root = tmp_path / "sandboxes"
    done = probe("local", tmp_path, RELAY_LOCAL_ISOLATION="bwrap", RELAY_LOCAL_ROOT=str(root))
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    [line] = done.stdout.splitlines()
    match = LINE.match(line)
    assert match and match["provider"] == "local" and match["verdict"] == "ok", line
    assert {"create", "exec", "terminate"} == set(re.findall(r"(\w+)=\d+ms", line))
    assert "disk" in match["limits"].split(",")  # the limits in force are shown
    assert list(root.iterdir()) == []  # the sandbox is gone


@pytest.mark.slow  # runs the relay CLI in a subprocess: seconds
def test_local_probe_says_the_same_as_json(tmp_path: Path) -> None:
    root = tmp_path / "sandboxes"
    done = probe(
        "local", tmp_path, "--json", RELAY_LOCAL_ISOLATION="bwrap", RELAY_LOCAL_ROOT=str(root)
    )
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    found = json.loads(done.stdout)
    assert found["ok"] is True and found["provider"] == "local" and found["failed_step"] is None
    assert set(found["timings_ms"]) == {"create", "exec", "terminate"}
    assert found["started_at"].endswith("Z") and found["limits"]["disk"] is True


@pytest.mark.slow  # runs the relay CLI in a subprocess: seconds
def test_unknown_or_unconfigured_provider_exits_2(tmp_path: Path) -> None:
    unknown = probe("nope", tmp_path)
    assert unknown.returncode == 2 and unknown.stderr.startswith("error: ")
    unset = probe("vercel", tmp_path)
    assert unset.returncode == 2 and "RELAY_VERCEL_TOKEN" in unset.stderr
    assert "Traceback" not in unknown.stderr + unset.stderr


@pytest.fixture
def hostile() -> Iterator[str]:
    """A provider API that refuses everything, quoting the key it was sent."""

    class Handler(BaseHTTPRequestHandler):
        def do_any(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            quoted = f"{CANARY} {self.headers.get('Authorization')}"
            body = json.dumps({"error": {"code": "forbidden", "message": quoted}}).encode()
            self.send_response(403)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_any

        def log_message(self, *args: Any) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_refusing_provider_fails_at_create_without_echoing_it(
    tmp_path: Path, hostile: str
) -> None:
    key = f"key-{CANARY}"
    done = probe(
        "vercel",
        tmp_path,
        RELAY_VERCEL_TOKEN=key,
        RELAY_VERCEL_TEAM_ID="team_x",
        RELAY_VERCEL_PROJECT_ID="prj_x",
        RELAY_VERCEL_BASE_URL=hostile,
        RELAY_CREATE_TIMEOUT_S="5",
    )
    assert done.returncode == 6  # the provider failed
    [line] = done.stdout.splitlines()
    match = LINE.match(line)
    assert match and match["verdict"] == "failed at create", line
    assert done.stderr.splitlines()[-1].startswith("error: provider_auth: ")
    assert CANARY not in done.stdout + done.stderr


@pytest.mark.parametrize("provider", ON_FAKES)
async def test_cloud_probe_through_the_real_sdk_leaves_nothing_alive(
    provider: str, tmp_path: Path
) -> None:
    """Each cloud provider, through its real SDK, against its protocol fake."""
    with RIGS[provider].started(tmp_path) as rig:
        result = await run_probe(provider, rig.settings())
        assert result.ok, result.error
        assert set(result.timings_ms) == {"create", "exec", "terminate"}
        assert LINE.match(result.line()), result.line()
        assert rig.alive() == set()


def pooled_row(
    name: str, provider: str, state: str, created_at: float, **values: Any
) -> PoolRecord:
    return PoolRecord(
        id=f"pool_{name}",
        shape="s",
        job="warm",
        provider=provider,
        holder="replica-a" if name < "m" else "replica-b",
        state=state,
        cpu=1.0,
        memory_mb=1024,
        created_at=created_at,
        expires_at=created_at + 60,
        **values,
    )


@pytest.mark.slow  # runs the relay CLI in a subprocess: seconds
async def test_a_probe_shows_the_providers_warm_pools_when_the_store_has_some(
    tmp_path: Path,
) -> None:
    """Relay-wide (both holders) and today's (UTC), like an admin's /v1/usage: ready now,
    claimed today, idle time and cost of today's; other providers' rows are not counted.
    A store that is missing or older leaves the line as before, and is not created."""
    today = day_start(time.time()) + 1
    store = await Store.open(f"sqlite:///{tmp_path / 'relay.db'}")
    rows = PoolRows(store)
    for record in (
        pooled_row("ready", "memory", READY, today),
        pooled_row(
            "claimed", "memory", CLAIMED, today, claimed_at=today + 4, idle_s=4.2, idle_usd=0.5
        ),
        pooled_row("old", "memory", ENDED, today - 2 * 86_400, idle_s=300, idle_usd=9),
        pooled_row("other", "local", READY, today, idle_s=50, idle_usd=5),
    ):
        await rows.add(record, cap=100)
    await store.close()

    done = probe("memory", tmp_path, RELAY_DATABASE_URL=f"sqlite:///{tmp_path / 'relay.db'}")
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    [line] = done.stdout.splitlines()
    assert LINE.match(line), line
    assert line.endswith(
        " pool_ready=1 pool_claimed=1 pool_idle_s=4 pool_idle_usd=0.500000 limits=none"
    ), line

    older = tmp_path / "older.db"
    with contextlib.closing(sqlite3.connect(older)) as conn:
        conn.execute("CREATE TABLE meta (key TEXT, value TEXT)")
    unreachable = "postgresql://relay@127.0.0.1:1/relay"  # nothing listens on port 1
    for url in (f"sqlite:///{tmp_path / 'missing.db'}", f"sqlite:///{older}", unreachable):
        result = await _probe("memory", make_settings(tmp_path, database_url=url))
        assert result.ok and result.pool == {} and LINE.match(result.line())
        assert "pool_" not in result.line() and "limits" not in result.line()
    assert not (tmp_path / "missing.db").exists()


async def test_the_pool_summary_reads_either_store(database_url: str) -> None:
    store = await Store.open(database_url)
    today = day_start(time.time()) + 1
    try:
        await PoolRows(store).add(
            pooled_row("ended", "memory", ENDED, today, idle_s=2.0, idle_usd=0.25), cap=100
        )
    finally:
        await store.close()
    summary = await read_summary(database_url, "memory", today - 1)
    assert summary == PoolSummary(ready=0, claimed=0, idle_s=2.0, idle_usd=0.25)
    assert await read_summary(database_url, "e2b", today - 1) is None


async def test_a_probe_shows_the_providers_breakers_as_the_live_replicas_last_wrote_them(
    database_url: str, tmp_path: Path
) -> None:
    """Each replica's breakers live in its memory; its heartbeat writes them beside it, and
    the probe reads the live replicas': one open and one closed read as both, a replica
    whose heartbeat is old is not counted."""
    settings = make_settings(tmp_path, database_url=database_url, breaker_failures=2)
    breakers = Breakers(settings)
    store = await Store.open(database_url)
    try:
        breakers.failed("memory", "provider_unavailable")
        breakers.failed("memory", "provider_unavailable")
        await store.heartbeat("replica-a", breakers.snapshot(["memory"]))
        await store.heartbeat("replica-b", Breakers(settings).snapshot(["memory"]))
        await store.heartbeat("replica-gone", breakers.snapshot(["memory"]))
        await store.write(
            lambda conn: conn.execute(
                replicas.update().where(replicas.c.id == "replica-gone").values(seen_at=0)
            )
        )
    finally:
        await store.close()
    result = await _probe("memory", settings)
    assert result.breaker == {"breaker": "closed:1,open:1", "breaker_failures": "2"}
    assert result.line().endswith(" breaker=closed:1,open:1 breaker_failures=2 limits=none")
    assert await read_breakers(database_url, "e2b") is None


async def test_the_pool_summary_leaves_no_file_beside_a_sqlite_store(tmp_path: Path) -> None:
    """Open (a relay writing: read through its -wal) or closed (read as it is): the read
    creates nothing beside the file, so no probe run by another user leaves the relay a
    -shm it cannot open."""
    url = f"sqlite:///{tmp_path / 'relay.db'}"
    today = day_start(time.time()) + 1
    store = await Store.open(url)
    try:
        await PoolRows(store).add(pooled_row("ready", "memory", READY, today), cap=100)
        beside = sorted(path.name for path in tmp_path.iterdir())
        assert beside == ["relay.db", "relay.db-shm", "relay.db-wal"]
        open_store = await read_summary(url, "memory", today - 1)
    finally:
        await store.close()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["relay.db"]
    closed_store = await read_summary(url, "memory", today - 1)
    assert open_store == closed_store == PoolSummary(ready=1, claimed=0, idle_s=0.0, idle_usd=0.0)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["relay.db"]


@pytest.mark.slow  # runs the relay CLI in a subprocess: seconds
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare"
)
def test_a_store_host_whose_name_never_resolves_holds_the_probe_3_s_at_most(
    tmp_path: Path,
) -> None:
    """A name server that never answers (a loopback socket, bound in for /etc/resolv.conf in
    a mount namespace of the probe's own): the lookup is left behind at the timeout, the
    line and exit are the provider's, the password is never shown."""
    address = f"127.{secrets.randbelow(200) + 20}.{secrets.randbelow(250) + 1}.53"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:
        silent.bind((address, 53))
        resolv = tmp_path / "resolv.conf"
        resolv.write_text(f"nameserver {address}\noptions timeout:5 attempts:2\n")
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(tmp_path),
            "RELAY_DATABASE_URL": f"postgresql://relay:{CANARY}@db.relay-probe.invalid/relay",
        }
        script = 'mount --bind "$1" /etc/resolv.conf && exec "$2" -m relay probe memory'
        command = ["sh", "-c", script, "sh", str(resolv), sys.executable]
        with subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", *command],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ) as probe:
            try:
                # The store's wait begins with the lookup: timed from the name's first
                # query, not from the start of a process whose imports a busy machine slows.
                silent.settimeout(60)
                assert silent.recv(512)  # the name was asked of the silent server
                asked = time.monotonic()
                stdout, stderr = probe.communicate(timeout=60)
                waited = time.monotonic() - asked
            finally:
                probe.kill()
    assert (probe.returncode, stderr) == (0, ""), stderr
    [line] = stdout.splitlines()
    assert LINE.match(line) and "pool_" not in line and CANARY not in line, line
    # 3 s for the store (both of its reads), then the line and the exit; the lookup: 10 s.
    assert waited < 5, waited


@pytest.mark.slow  # runs the relay CLI in a subprocess: seconds
def test_a_local_probe_leaves_no_folder_where_the_store_path_names_none(tmp_path: Path) -> None:
    """The local sandbox root follows the SQLite file's folder: a mistyped or not yet made
    path is made for the probe's sandbox, then taken away again."""
    url = f"sqlite:///{tmp_path / 'missing' / 'deeper' / 'relay.db'}"
    done = probe("local", tmp_path, RELAY_LOCAL_ISOLATION="bwrap", RELAY_DATABASE_URL=url)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    [line] = done.stdout.splitlines()
    assert LINE.match(line) and " ok " in line and "pool_" not in line, line
    assert sorted(path.name for path in tmp_path.iterdir()) == []


@pytest.mark.slow  # a relay killed or restarted, then waited for (make check leaves it out)
def test_a_probe_or_a_reap_beside_a_serving_relay_leaves_its_cgroups_alone(
    tmp_path: Path,
) -> None:
    """`relay probe local` and `relay reap` (from cron) on the host of a serving relay, with
    the same settings: the relay's runs still get their cgroup afterwards (each closing
    process removed the shared folder of groups when it found it empty)."""
    from testing.relay_server import RelayProcess

    relay = RelayProcess(tmp_path / "relay", local_isolation="bwrap")
    relay.add_token("ops", jobs=["echo"])
    relay.start()
    try:
        limits = relay.get(relay.tokens["ops"], "/v1/providers").json()["providers"][0]["limits"]
        if limits.get("cgroup") is None:
            pytest.skip("no cgroups on this host")
        body = {"job": "echo", "params": {"message": "x"}}
        assert relay.post(relay.tokens["ops"], body).json()["state"] == "succeeded"
        beside = {k: v for k, v in relay.env.items() if k != "PATH"}
        for command in (["probe", "local"], ["reap"]):
            done = subprocess.run(
                [sys.executable, "-m", "relay", *command], cwd=relay.root,
                env={"PATH": os.environ["PATH"], **beside},
                capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            answer = relay.post(relay.tokens["ops"], body)
            assert answer.status_code == 200, (command, answer.text)
            assert answer.json()["state"] == "succeeded"
    finally:
        relay.stop()
