"""The fake E2B's state: sandboxes as temp dirs with real subprocesses, a ledger, faults.

Everything here runs on the fake's own event loop (a background thread), except the
ledger's read methods, which tests call from their own thread under a lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

TEMPLATES: dict[str, tuple[int, int]] = {"base": (2, 512)}
"""Template name -> (vCPUs, MiB); any other name is served with the base size."""
ENVD_VERSION = "0.6.7"
HOME = "/home/user"


@dataclass
class Faults:
    """Failures the next calls suffer; sticky until :meth:`reset`.

    ``cut_stream`` ends a Start stream cleanly after its first event, without an end event;
    ``drop_connection`` aborts it mid-body (a dropped connection). Connect streams (the
    client following the command again) are never cut.
    """

    create_status: int | None = None
    create_hang: bool = False
    create_allocates_then_fails: bool = False
    cut_stream: bool = False
    drop_connection: bool = False
    terminate_failures: int = 0
    vanish_after_s: float | None = None
    create_answers_lost: int = 0
    """The next N creates allocate the sandbox, then answer 502 (a gateway that lost the
    answer): the SDK retries a 502, and only an ``Idempotency-Key`` makes that safe."""

    def reset(self) -> None:
        self.create_answers_lost = 0
        self.create_status = None
        self.create_hang = False
        self.create_allocates_then_fails = False
        self.cut_stream = False
        self.drop_connection = False
        self.terminate_failures = 0
        self.vanish_after_s = None


@dataclass
class FakeProcess:
    """A running command and the streams (Start, Connect) currently following it."""

    process: asyncio.subprocess.Process
    subscribers: list[asyncio.Queue[tuple[str, Any]]] = field(default_factory=list)

    def subscribe(self) -> asyncio.Queue[tuple[str, Any]]:
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.subscribers.append(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[tuple[str, Any]]) -> None:
        with contextlib.suppress(ValueError):
            self.subscribers.remove(queue)

    def publish(self, event: tuple[str, Any]) -> None:
        for queue in list(self.subscribers):
            queue.put_nowait(event)


@dataclass
class FakeSandbox:
    """One sandbox: a private directory tree and the processes started in it."""

    sandbox_id: str
    template: str
    timeout_s: int
    metadata: dict[str, str]
    envs: dict[str, str]
    root: Path
    access_token: str
    started_at: float = field(default_factory=time.time)
    end_at: float = 0.0
    processes: dict[int, FakeProcess] = field(default_factory=dict)
    timer: asyncio.TimerHandle | None = None
    pumps: set[asyncio.Task[None]] = field(default_factory=set)

    def host_path(self, path: str) -> Path:
        """Map an absolute (or home-relative) sandbox path under this sandbox's root."""
        posix = PurePosixPath(path)
        if not posix.is_absolute():
            posix = PurePosixPath(HOME) / posix
        parts = [part for part in posix.parts[1:] if part not in ("..", ".")]
        return self.root.joinpath(*parts)


class Ledger:
    """What happened, for tests: creates as received, kills, signals, expiries."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sandboxes: dict[str, FakeSandbox] = {}
        self.created: list[dict[str, Any]] = []
        self.create_attempts = 0
        self.terminated: list[tuple[str, float]] = []
        self.expired: list[tuple[str, float]] = []
        self.signals: list[tuple[str, int, str]] = []
        self.commands: list[dict[str, Any]] = []
        self.reconnects: list[tuple[str, int]] = []
        self.timeouts: list[tuple[str, int]] = []
        """``set_timeout`` calls: sandbox, its new timeout."""

    def alive(self) -> set[str]:
        with self.lock:
            return set(self.sandboxes)

    def create_of(self, sandbox_id: str) -> dict[str, Any] | None:
        with self.lock:
            for entry in self.created:
                if entry["sandbox_id"] == sandbox_id:
                    return entry
        return None


class World:
    """The fake's sandboxes and the operations the HTTP handlers call."""

    def __init__(self) -> None:
        self.ledger = Ledger()
        self.faults = Faults()
        self.page_size = 100  # list answers at most this many sandboxes a page
        self.idempotency: dict[str, str] = {}
        """``Idempotency-Key`` → the sandbox its first create made (a replay answers it)."""
        self.base_dir = Path(tempfile.mkdtemp(prefix="fake-e2b-"))

    def create(self, body: dict[str, Any]) -> FakeSandbox:
        sandbox_id = "i" + secrets.token_hex(10)
        root = self.base_dir / sandbox_id
        for directory in ("home/user", "workspace", "tmp"):
            (root / directory).mkdir(parents=True)
        timeout_s = int(body.get("timeout") or 300)
        sandbox = FakeSandbox(
            sandbox_id=sandbox_id,
            template=str(body.get("templateID") or "base"),
            timeout_s=timeout_s,
            metadata=dict(body.get("metadata") or {}),
            envs=dict(body.get("envVars") or {}),
            root=root,
            access_token=secrets.token_hex(16),
        )
        self._arm(sandbox, timeout_s)
        entry = {
            "sandbox_id": sandbox_id,
            "template": sandbox.template,
            "image": sandbox.template,
            "timeout": body.get("timeout"),
            "lifetime": body.get("timeout"),
            "metadata": dict(sandbox.metadata),
            "tags": dict(sandbox.metadata),
            "allow_internet_access": body.get("allow_internet_access"),
            "network": body.get("network"),
            "auto_pause": body.get("autoPause"),
            "resources": None,
            "env_names": sorted(sandbox.envs),
        }
        with self.ledger.lock:
            self.ledger.sandboxes[sandbox_id] = sandbox
            self.ledger.created.append(entry)
        if self.faults.vanish_after_s is not None:
            loop = asyncio.get_running_loop()
            loop.call_later(self.faults.vanish_after_s, self._vanish, sandbox_id)
        return sandbox

    def _arm(self, sandbox: FakeSandbox, timeout_s: int) -> None:
        # The fake enforces the lifetime itself, like E2B: at end_at the sandbox dies.
        if sandbox.timer is not None:
            sandbox.timer.cancel()
        sandbox.end_at = time.time() + timeout_s
        loop = asyncio.get_running_loop()
        sandbox.timer = loop.call_later(timeout_s, self._expire, sandbox.sandbox_id)

    def set_timeout(self, sandbox_id: str, timeout_s: int) -> bool:
        sandbox = self.get(sandbox_id)
        if sandbox is None:
            return False
        with self.ledger.lock:
            self.ledger.timeouts.append((sandbox_id, timeout_s))
        self._arm(sandbox, timeout_s)
        return True

    def get(self, sandbox_id: str) -> FakeSandbox | None:
        with self.ledger.lock:
            return self.ledger.sandboxes.get(sandbox_id)

    def kill(self, sandbox_id: str) -> bool:
        """Kill through the API; False when there is no such live sandbox."""
        if self._remove(sandbox_id) is None:
            return False
        with self.ledger.lock:
            self.ledger.terminated.append((sandbox_id, time.time()))
        return True

    def _expire(self, sandbox_id: str) -> None:
        if self._remove(sandbox_id) is not None:
            with self.ledger.lock:
                self.ledger.expired.append((sandbox_id, time.time()))

    def _vanish(self, sandbox_id: str) -> None:
        self._expire(sandbox_id)

    def _remove(self, sandbox_id: str) -> FakeSandbox | None:
        with self.ledger.lock:
            sandbox = self.ledger.sandboxes.pop(sandbox_id, None)
        if sandbox is None:
            return None
        if sandbox.timer is not None:
            sandbox.timer.cancel()
        for running in sandbox.processes.values():
            kill_group(running.process)
            running.publish(("gone", None))
        shutil.rmtree(sandbox.root, ignore_errors=True)
        return sandbox

    def signal(self, sandbox: FakeSandbox, pid: int, name: str) -> bool:
        running = sandbox.processes.get(pid)
        with self.ledger.lock:
            self.ledger.signals.append((sandbox.sandbox_id, pid, name))
        if running is None or running.process.returncode is not None:
            return False
        sig = signal.SIGKILL if name == "SIGNAL_SIGKILL" else signal.SIGTERM
        kill_group(running.process, sig)
        return True

    async def shutdown(self) -> None:
        """Kill every sandbox and wait for its processes (the fake is going away)."""
        with self.ledger.lock:
            ids = list(self.ledger.sandboxes)
        processes = [p.process for s in self._sandboxes() for p in s.processes.values()]
        for sandbox_id in ids:
            self._remove(sandbox_id)
        for process in processes:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(process.wait(), 5)
        shutil.rmtree(self.base_dir, ignore_errors=True)

    def _sandboxes(self) -> list[FakeSandbox]:
        with self.ledger.lock:
            return list(self.ledger.sandboxes.values())


def kill_group(process: asyncio.subprocess.Process, sig: int = signal.SIGKILL) -> None:
    """Signal the process group (each command is a session leader)."""
    if process.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)
