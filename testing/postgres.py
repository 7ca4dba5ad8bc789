"""A real, throwaway PostgreSQL for tests: ``start_postgres()`` and the ``postgres_url`` fixture.

The server is Debian's (``/usr/lib/postgresql/<version>/bin``). When it is missing and the
tests run as root (CI, a developer's container), ``apt-get install postgresql`` brings it in.
Each start gets its own data directory in a temp folder, listens on 127.0.0.1 on a free port
(its unix socket in that temp folder too, so it never touches a system cluster), trusts
loopback connections, and is stopped and deleted afterwards. The server is a daemon, which
outlives a test process killed outright: its folder names that process (``owner``), and the
next start on this host stops and deletes every server whose owner is gone (never another
live run's).

When no server can be had (not root and none installed, or the install fails) the tests
that asked for one are *skipped with the reason* — never passed silently. Two environment
variables change that:

``RELAY_TEST_POSTGRES_URL``
    use this running server instead of starting one (``postgresql+asyncpg://…``);
``RELAY_TEST_REQUIRE_POSTGRES=1``
    fail instead of skipping (for CI, where a skipped PostgreSQL suite is a failure).

Usage, in a conftest.py::

    from testing.postgres import postgres_url  # noqa: F401  (a session fixture)
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import fcntl
import glob
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import asyncpg
import psutil
import pytest

SERVER_GLOB = "/usr/lib/postgresql/*/bin/initdb"
SUPERUSER = "relay"
DATABASE = "relay_test"
SERVICE_USER = "postgres"
"""The OS user that runs the server when the tests run as root (initdb refuses root)."""

START_TIMEOUT_S = 30
INSTALL_TIMEOUT_S = 600


def _unavailable(reason: str) -> NoReturn:
    """Skip (or fail, when PostgreSQL is required) with the exact reason."""
    message = f"PostgreSQL unavailable: {reason}"
    if os.environ.get("RELAY_TEST_REQUIRE_POSTGRES") == "1":
        pytest.fail(message + " (RELAY_TEST_REQUIRE_POSTGRES=1)", pytrace=False)
    pytest.skip(message)


def _version_key(initdb: Path) -> tuple[int, ...]:
    version = initdb.parent.parent.name  # /usr/lib/postgresql/<version>/bin/initdb
    return tuple(int(part) for part in re.findall(r"\d+", version)) or (0,)


def find_server() -> Path | None:
    """The bin directory of the newest Debian PostgreSQL server installed, if any."""
    found = sorted((Path(p) for p in glob.glob(SERVER_GLOB)), key=_version_key)
    for initdb in reversed(found):
        bin_dir = initdb.parent
        if all(os.access(bin_dir / name, os.X_OK) for name in ("initdb", "pg_ctl", "createdb")):
            return bin_dir
    return None


def _is_root() -> bool:
    return os.geteuid() == 0


def _install_server() -> None:
    """``apt-get install postgresql``, quietly; raise with apt's last lines on failure."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (
        ["apt-get", "update", "-qq"],
        # Another apt (unattended upgrades) is waited for, not failed on.
        [
            "apt-get",
            "-o",
            f"DPkg::Lock::Timeout={INSTALL_TIMEOUT_S}",
            "install",
            "-y",
            "-qq",
            "--no-install-recommends",
            "postgresql",
        ],
    ):
        result = subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False
        )
        if result.returncode != 0:
            tail = " | ".join((result.stderr or result.stdout).strip().splitlines()[-3:])
            raise RuntimeError(f"`{' '.join(argv)}` exited {result.returncode}: {tail}")


def _server_or_skip() -> Path:
    bin_dir = find_server()
    if bin_dir is not None:
        return bin_dir
    # Test workers (pytest -n) may all get here at once, and another copy of the suite, or
    # its scripts/system-deps.sh: apt-get takes one at a time.
    with _one_process_at_a_time(APT_LOCK):
        return _installed_server_or_skip()


APT_LOCK = Path("/tmp/relay-apt.lock")
"""Whose holder may run apt-get: every copy of the suite on the host, scripts/system-deps.sh
too (only root installs)."""


@contextlib.contextmanager
def _one_process_at_a_time(path: Path) -> Iterator[None]:
    """A lock on ``path``, held while the block runs."""
    with path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _installed_server_or_skip() -> Path:
    bin_dir = find_server()
    if bin_dir is not None:  # another worker installed it meanwhile
        return bin_dir
    if not _is_root():
        _unavailable(
            f"no server binaries ({SERVER_GLOB}) and not root, so `apt-get install postgresql` "
            "cannot run; install Debian's postgresql or set RELAY_TEST_POSTGRES_URL"
        )
    if shutil.which("apt-get") is None:
        _unavailable(f"no server binaries ({SERVER_GLOB}) and no apt-get to install them")
    try:
        _install_server()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        _unavailable(f"installing Debian's postgresql failed: {exc}")
    bin_dir = find_server()
    if bin_dir is None:
        _unavailable(f"`apt-get install postgresql` ran but found no {SERVER_GLOB}")
    return bin_dir


def temp_base() -> Path:
    """Where data directories go: the temp folder, or /tmp when the server runs as another
    user (as root, TMPDIR may sit under /root, which that user cannot enter)."""
    if _is_root() and Path("/tmp").is_dir():
        return Path("/tmp")
    return Path(tempfile.gettempdir())


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _service_user_or_skip() -> str:
    """As root, the server must run as another user; make sure it exists."""
    with _one_process_at_a_time(temp_base() / "relay-test-postgres-user.lock"):
        _make_service_user()
    return SERVICE_USER


def _make_service_user() -> None:
    try:
        pwd.getpwnam(SERVICE_USER)
    except KeyError:
        created = subprocess.run(
            [
                "useradd",
                "--system",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                SERVICE_USER,
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if created.returncode != 0:
            _unavailable(
                f"running as root and cannot create user {SERVICE_USER!r}: {created.stderr.strip()}"
            )


class _Server:
    """One initdb'd data directory and the commands that run against it."""

    def __init__(self, bin_dir: Path, root: Path, run_as: str | None) -> None:
        self.bin_dir = bin_dir
        self.root = root
        self.data = root / "data"
        self.sockets = root / "sockets"
        self.log = root / "server.log"
        self.run_as = run_as
        self.port = 0
        # The server's environment: no PG* variables of the caller, a plain C locale.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        self.env.update(LC_ALL="C", LANG="C")

    def run(self, tool: str, *args: str, timeout: float = START_TIMEOUT_S) -> None:
        argv: list[str] = [str(self.bin_dir / tool), *args]
        if self.run_as is not None:
            argv = ["runuser", "-u", self.run_as, "--", *argv]
        result = subprocess.run(
            argv, env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"{tool} exited {result.returncode}: {_last_lines(result.stderr or result.stdout)}"
                + self._log_tail()
            )

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return f"; server log: {_last_lines(self.log.read_text(errors='replace'))}"
        return ""

    def init(self) -> None:
        self.sockets.mkdir()
        if self.run_as is not None:
            shutil.chown(self.root, user=self.run_as)
            shutil.chown(self.sockets, user=self.run_as)
        self.run(
            "initdb",
            "--pgdata", str(self.data),
            "--username", SUPERUSER,
            "--auth", "trust",
            "--encoding", "UTF8",
            "--locale", "C",
            "--no-sync",
        )  # fmt: skip

    def start(self) -> None:
        options = " ".join(
            (
                f"-c port={self.port}",
                "-c listen_addresses=127.0.0.1",
                f"-c unix_socket_directories={self.sockets}",
                # A test server: durability buys nothing here and costs seconds.
                "-c fsync=off",
                "-c synchronous_commit=off",
                "-c full_page_writes=off",
                "-c shared_buffers=32MB",
                "-c max_connections=200",
            )
        )
        self.run(
            "pg_ctl", "start", "--pgdata", str(self.data), "--log", str(self.log),
            "--wait", f"--timeout={START_TIMEOUT_S}", "--options", options,
        )  # fmt: skip

    def create_database(self) -> None:
        self.run(
            "createdb", "--host", "127.0.0.1", "--port", str(self.port),
            "--username", SUPERUSER, DATABASE,
        )  # fmt: skip

    def stop(self) -> None:
        # `immediate`: nothing to keep; the data directory is deleted right after.
        try:
            self.run("pg_ctl", "stop", "--pgdata", str(self.data), "--mode", "immediate", "--wait")
        except (RuntimeError, OSError, subprocess.TimeoutExpired):
            self._kill()
            raise

    def _kill(self) -> None:
        """Last resort: SIGKILL the postmaster named in postmaster.pid."""
        with contextlib.suppress(OSError, ValueError, IndexError):
            pid = int((self.data / "postmaster.pid").read_text().splitlines()[0])
            os.kill(pid, signal.SIGKILL)


OWNER = "owner"
"""In a server's folder: ``PID START`` of the process it serves (``psutil`` create time)."""


def _claim(root: Path) -> None:
    """Name this process the owner of the server in ``root``."""
    me = psutil.Process()
    (root / OWNER).write_text(f"{me.pid} {me.create_time()!r}\n")


def _owner_alive(root: Path) -> bool:
    """Whether the process that started the server in ``root`` still runs (a folder with
    no owner yet is being made: alive)."""
    try:
        pid, started = (root / OWNER).read_text().split()
        return abs(psutil.Process(int(pid)).create_time() - float(started)) < 0.5
    except FileNotFoundError:
        return True
    except (OSError, ValueError, psutil.Error):
        return False


def sweep_leftovers() -> list[Path]:
    """Stop and delete the servers of test processes that are gone (a run killed outright
    left them running, each holding its memory and port); those of live processes, this
    run's or another's, are left alone. Returns the folders removed."""
    removed = []
    for root in temp_base().glob("relay-pg-*"):
        if not root.is_dir() or _owner_alive(root):
            continue
        with contextlib.suppress(OSError, ValueError, IndexError, psutil.Error):
            pid = int((root / "data" / "postmaster.pid").read_text().splitlines()[0])
            postmaster = psutil.Process(pid)
            if str(root / "data") in postmaster.cmdline():  # its own, not a reused pid
                _stop_abandoned(postmaster)
        shutil.rmtree(root, ignore_errors=True)
        removed.append(root)
    return removed


def _stop_abandoned(postmaster: psutil.Process) -> None:
    """An immediate shutdown (SIGQUIT: its backends end and its shared memory goes), thawed
    first (a test that froze it may have been killed); SIGKILL if it does not end."""
    for each in [postmaster, *postmaster.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            each.resume()
    postmaster.send_signal(signal.SIGQUIT)
    try:
        postmaster.wait(START_TIMEOUT_S)
    except psutil.TimeoutExpired:
        postmaster.kill()


_swept: list[bool] = []
"""Whether this process swept already (once is enough: what it starts, it stops)."""


def _last_lines(text: str, count: int = 5) -> str:
    return " | ".join(text.strip().splitlines()[-count:])


def _start_on_free_port(server: _Server, attempts: int = 3) -> None:
    """Start on a free port; retry on another if a concurrent process took it meanwhile."""
    error: RuntimeError | None = None
    for _ in range(attempts):
        server.port = _free_port()
        try:
            server.start()
        except RuntimeError as exc:
            error = exc
            if "already in use" not in str(exc) and "could not bind" not in str(exc):
                break
        else:
            return
    assert error is not None
    raise error


@contextlib.contextmanager
def start_postgres() -> Iterator[str]:
    """Start a throwaway PostgreSQL; yield ``postgresql+asyncpg://relay@127.0.0.1:PORT/relay_test``.

    Skips the calling test (with the reason) when no server can be had; stops the server
    and deletes its files on exit, also when the body raised.
    """
    external = os.environ.get("RELAY_TEST_POSTGRES_URL")
    if external:
        yield external
        return
    with own_postgres() as (_, url):
        yield url


class Outage:
    """Stops and starts a test's own PostgreSQL (same data, same port)."""

    def __init__(self, server: _Server) -> None:
        self._server = server

    def stop(self) -> None:
        self._server.stop()

    def start(self) -> None:
        self._server.start()

    def freeze(self) -> None:
        """SIGSTOP the server and its backends: it holds its connections and answers
        nothing (a network partition); :meth:`thaw` lets it go on."""
        self._signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self._signal(signal.SIGCONT)

    def _signal(self, number: int) -> None:
        pid = int((self._server.data / "postmaster.pid").read_text().splitlines()[0])
        server = psutil.Process(pid)
        for each in [server, *server.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                each.send_signal(number)


_MARKED: contextvars.ContextVar[bool | None] = contextvars.ContextVar("marked", default=None)
"""Whether the running test carries the ``postgres`` mark (None: not in a test)."""


@contextlib.contextmanager
def marked(carries_the_mark: bool) -> Iterator[None]:
    """Says, for the test that runs in the block, whether it is marked ``postgres``."""
    token = _MARKED.set(carries_the_mark)
    try:
        yield
    finally:
        _MARKED.reset(token)


@contextlib.contextmanager
def own_postgres() -> Iterator[tuple[Outage, str]]:
    """A PostgreSQL of the caller's own (never the external one), which it may stop and
    start: yields an :class:`Outage` and the URL. The test that calls it is marked
    ``postgres`` (`make check` leaves those out), else it fails saying so."""
    if _MARKED.get() is False:
        pytest.fail("a test that starts PostgreSQL is marked so: @pytest.mark.postgres")
    bin_dir = _server_or_skip()
    run_as = _service_user_or_skip() if _is_root() else None
    if not _swept:
        _swept.append(True)
        sweep_leftovers()
    root = Path(tempfile.mkdtemp(prefix="relay-pg-", dir=temp_base()))
    _claim(root)
    server = _Server(bin_dir, root, run_as)
    started = False
    try:
        try:
            server.init()
            _start_on_free_port(server)
            started = True
            server.create_database()
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            _unavailable(f"could not start {bin_dir.parent.name} in {root}: {exc}")
        yield Outage(server), f"postgresql+asyncpg://{SUPERUSER}@127.0.0.1:{server.port}/{DATABASE}"
    finally:
        if started:
            with contextlib.suppress(OSError, ValueError, psutil.Error):
                Outage(server).thaw()  # a test that froze it and failed
            with contextlib.suppress(RuntimeError, OSError, subprocess.TimeoutExpired):
                server.stop()
        shutil.rmtree(root, ignore_errors=True)


async def new_database(server_url: str) -> str:
    """A new, empty database on the test PostgreSQL server; its SQLAlchemy URL."""
    name = "t_" + secrets.token_hex(6)
    admin = await asyncpg.connect(server_url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    return server_url.rsplit("/", 1)[0] + "/" + name


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A real PostgreSQL for the whole session, as a SQLAlchemy asyncpg URL.

    A session is one process: each worker of ``pytest -n`` starts a server of its own, and
    with ``RELAY_TEST_POSTGRES_URL`` gets a database of its own there, so that no two
    processes create the same tables at once."""
    external = os.environ.get("RELAY_TEST_POSTGRES_URL")
    if external:
        yield asyncio.run(new_database(external))
        return
    with own_postgres() as (_, url):
        yield url
