"""The fake Daytona's state: sandboxes as directories with real subprocesses, a ledger, faults.

Everything here runs on the fake's event loop (a background thread), except the ledger's
read methods, which tests call from their own thread under its lock.

Lifetimes are enforced as Daytona documents them, on a clock whose minute is
``World.minute_s`` seconds (60 unless a test shortens it): ``ttlMinutes`` after creation the
sandbox is destroyed whatever its state; ``autoStopInterval`` minutes without an API call
about it, it stops (its processes die), and an ephemeral one (``autoDeleteInterval: 0``)
is deleted as it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from testing.fakes.daytona.isolation import launch

HOME = "/home/daytona"
PRIVATE = ("workspace", "home/daytona", "tmp")


@dataclass
class Faults:
    """Faults the next requests meet, until :meth:`reset` (the contract's names)."""

    create_status: int | None = None
    """Every create answers this status without allocating."""
    create_hang: bool = False
    """Creates never answer (and allocate nothing) until reset."""
    create_allocates_then_fails: bool = False
    """Creates allocate the sandbox (alive, labelled), then answer 500."""
    cut_stream: bool = False
    """A command's first log stream closes cleanly after its first chunk."""
    terminate_failures: int = 0
    """The next N deletes answer 500."""
    vanish_after_s: float | None = None
    """Sandboxes created now disappear this long after creation (processes killed, 404)."""
    retry_after_s: str = "3"
    """The ``Retry-After`` a 429 carries."""

    def reset(self) -> None:
        fresh = Faults()
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(fresh, name))


@dataclass
class FakeCommand:
    """One session command: its process and every chunk of output, in order."""

    command_id: str
    line: str
    process: asyncio.subprocess.Process
    chunks: list[tuple[str, bytes]] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    exit_code: int | None = None
    followed: int = 0

    def append(self, stream: str, data: bytes) -> None:
        self.chunks.append((stream, data))
        self.changed.set()


@dataclass
class FakeSandbox:
    """One sandbox: a private directory tree, its sessions and their commands."""

    sandbox_id: str
    name: str
    body: dict[str, Any]
    root: Path
    created_at: float = field(default_factory=time.time)
    state: str = "started"
    last_activity: float = field(default_factory=time.monotonic)
    sessions: dict[str, dict[str, FakeCommand]] = field(default_factory=dict)
    timers: list[asyncio.TimerHandle] = field(default_factory=list)
    pumps: set[asyncio.Task[None]] = field(default_factory=set)
    gone: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.body.get("labels") or {})

    def host_path(self, path: str) -> Path:
        """Where an absolute sandbox path lives on the host (never outside the root)."""
        parts = [p for p in PurePosixPath("/", path).parts[1:] if p not in ("", ".", "..")]
        target = self.root.joinpath(*parts)
        if not target.resolve().is_relative_to(self.root.resolve()):
            raise ValueError("path leaves the sandbox")
        return target


class Ledger:
    """What happened, for tests: creates as received, deletes, expiries, stops."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sandboxes: dict[str, FakeSandbox] = {}
        self.created: list[dict[str, Any]] = []
        self.create_attempts = 0
        self.terminated: list[tuple[str, float]] = []
        self.destroying: dict[str, FakeSandbox] = {}
        """Deleted sandboxes the API still shows, ``destroying``, for a while (processes
        dead, nothing billed: not :meth:`alive`)."""
        self.expired: list[tuple[str, float]] = []
        self.stopped: list[tuple[str, float]] = []
        self.commands: list[dict[str, Any]] = []
        self.keys: set[str] = set()
        """Every bearer key a request carried (tests check only the relay's arrives)."""

    def alive(self) -> set[str]:
        """Sandboxes that exist (running or stopped: a stopped one still holds its disk)."""
        with self.lock:
            return set(self.sandboxes)

    def create_of(self, sandbox_id: str) -> dict[str, Any] | None:
        with self.lock:
            return next((e for e in self.created if e["sandbox_id"] == sandbox_id), None)

    def lifetime_of(self, sandbox_id: str) -> float | None:
        entry = self.create_of(sandbox_id)
        return None if entry is None else entry["lifetime"]

    def tags_of(self, sandbox_id: str) -> dict[str, str]:
        entry = self.create_of(sandbox_id)
        return {} if entry is None else dict(entry["labels"])


class World:
    """The fake's sandboxes and the operations its handlers call."""

    def __init__(self) -> None:
        self.ledger = Ledger()
        self.faults = Faults()
        self.minute_s = 60.0
        self.page_size = 100
        self.destroying_s = 0.5
        """How long a deleted sandbox stays visible (get, list) as ``destroying``: a delete
        answers at once with that state and the sandbox goes later, as Daytona's does."""
        self.hang = asyncio.Event()
        self.base_dir = Path(tempfile.mkdtemp(prefix="fake-daytona-"))

    # -- sandboxes --------------------------------------------------------------------------

    def create(self, body: dict[str, Any]) -> FakeSandbox:
        sandbox_id = str(uuid.uuid4())
        root = self.base_dir / sandbox_id
        for directory in PRIVATE:
            (root / directory).mkdir(parents=True)
        sandbox = FakeSandbox(sandbox_id, str(body.get("name") or sandbox_id), body, root)
        ttl = int(body.get("ttlMinutes") or 0)
        entry = {
            "sandbox_id": sandbox_id,
            "name": sandbox.name,
            "labels": sandbox.labels,
            "tags": sandbox.labels,
            "ttl_minutes": ttl,
            "lifetime": ttl * 60.0 if ttl else None,
            "auto_stop_minutes": body.get("autoStopInterval"),
            "auto_delete_minutes": body.get("autoDeleteInterval"),
            "network_block_all": body.get("networkBlockAll"),
            "network_allow_list": body.get("networkAllowList"),
            "domain_allow_list": body.get("domainAllowList"),
            "snapshot": body.get("snapshot"),
            "image": (body.get("buildInfo") or {}).get("dockerfileContent"),
            "resources": {k: body[k] for k in ("cpu", "memory", "disk") if k in body} or None,
            "target": body.get("target"),
            "env_names": sorted(body.get("env") or {}),
        }
        with self.ledger.lock:
            self.ledger.sandboxes[sandbox_id] = sandbox
            self.ledger.created.append(entry)
        loop = asyncio.get_running_loop()
        if ttl:
            sandbox.timers.append(loop.call_later(ttl * self.minute_s, self._expire, sandbox_id))
        if self.faults.vanish_after_s is not None:
            sandbox.timers.append(
                loop.call_later(self.faults.vanish_after_s, self._expire, sandbox_id)
            )
        self._arm_auto_stop(sandbox)
        return sandbox

    def _arm_auto_stop(self, sandbox: FakeSandbox) -> None:
        minutes = sandbox.body.get("autoStopInterval", 15)
        if not minutes:
            return
        delay = minutes * self.minute_s
        loop = asyncio.get_running_loop()

        def check() -> None:
            if sandbox.state != "started":
                return
            idle = time.monotonic() - sandbox.last_activity
            if idle >= delay:
                self.stop(sandbox.sandbox_id)
            else:
                sandbox.timers.append(loop.call_later(delay - idle, check))

        sandbox.timers.append(loop.call_later(delay, check))

    def get(self, sandbox_id: str) -> FakeSandbox | None:
        with self.ledger.lock:
            sandbox = self.ledger.sandboxes.get(sandbox_id)
            if sandbox is None:
                everything = [*self.ledger.sandboxes.values(), *self.ledger.destroying.values()]
                sandbox = self.ledger.destroying.get(sandbox_id) or next(
                    (s for s in everything if s.name == sandbox_id), None
                )
        if sandbox is not None:
            sandbox.last_activity = time.monotonic()
        return sandbox

    def listed(self) -> list[FakeSandbox]:
        with self.ledger.lock:
            everything = [*self.ledger.sandboxes.values(), *self.ledger.destroying.values()]
        return sorted(everything, key=lambda s: s.created_at)

    def delete(self, sandbox_id: str) -> FakeSandbox | None:
        sandbox = self._remove(sandbox_id)
        if sandbox is not None:
            with self.ledger.lock:
                self.ledger.terminated.append((sandbox.sandbox_id, time.time()))
            if self.destroying_s > 0:
                sandbox.state = "destroying"
                with self.ledger.lock:
                    self.ledger.destroying[sandbox.sandbox_id] = sandbox
                loop = asyncio.get_running_loop()
                loop.call_later(self.destroying_s, self._forget, sandbox.sandbox_id)
        return sandbox

    def _forget(self, sandbox_id: str) -> None:
        with self.ledger.lock:
            sandbox = self.ledger.destroying.pop(sandbox_id, None)
        if sandbox is not None:
            sandbox.state = "destroyed"

    def stop(self, sandbox_id: str) -> None:
        """Auto-stop: the processes die; an ephemeral sandbox is deleted with them."""
        sandbox = self.get(sandbox_id)
        if sandbox is None:
            return
        with self.ledger.lock:
            self.ledger.stopped.append((sandbox.sandbox_id, time.time()))
        if sandbox.body.get("autoDeleteInterval") == 0:
            self._expire(sandbox_id)
            return
        sandbox.state = "stopped"
        self._kill_processes(sandbox)

    def vanish(self, sandbox_id: str) -> None:
        """Kill a sandbox under whatever it runs, as Daytona losing it would."""
        self._expire(sandbox_id)

    def _expire(self, sandbox_id: str) -> None:
        sandbox = self._remove(sandbox_id)
        if sandbox is not None:
            with self.ledger.lock:
                self.ledger.expired.append((sandbox.sandbox_id, time.time()))

    def _remove(self, sandbox_id: str) -> FakeSandbox | None:
        with self.ledger.lock:
            sandbox = self.ledger.sandboxes.get(sandbox_id)
            if sandbox is None:
                sandbox = next(
                    (s for s in self.ledger.sandboxes.values() if s.name == sandbox_id), None
                )
            if sandbox is None:
                return None
            del self.ledger.sandboxes[sandbox.sandbox_id]
        for timer in sandbox.timers:
            timer.cancel()
        sandbox.state = "destroyed"
        self._kill_processes(sandbox)
        sandbox.gone.set()
        shutil.rmtree(sandbox.root, ignore_errors=True)
        return sandbox

    @staticmethod
    def _kill_processes(sandbox: FakeSandbox) -> None:
        for commands in sandbox.sessions.values():
            for command in commands.values():
                kill_group(command.process)

    # -- sessions ---------------------------------------------------------------------------

    async def execute(self, sandbox: FakeSandbox, session: str, line: str) -> FakeCommand:
        """Start a session command: ``sh -c line`` inside the sandbox's view."""
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LANG": "C.UTF-8",
            "HOME": HOME,
            **(sandbox.body.get("env") or {}),
        }
        isolate = bool(sandbox.body.get("networkBlockAll"))
        argv, cwd = launch(sandbox.root, line, HOME, isolate_network=isolate)
        process = await asyncio.create_subprocess_exec(
            *argv,
            cwd=cwd,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        command = FakeCommand(uuid.uuid4().hex, line, process)
        sandbox.sessions.setdefault(session, {})[command.command_id] = command
        with self.ledger.lock:
            self.ledger.commands.append({"sandbox_id": sandbox.sandbox_id, "command": line})
        sandbox.pumps.add(asyncio.get_running_loop().create_task(_pump(command)))
        return command

    def end_session(self, sandbox: FakeSandbox, session: str) -> bool:
        commands = sandbox.sessions.pop(session, None)
        if commands is None:
            return False
        for command in commands.values():
            kill_group(command.process)
        return True

    async def shutdown(self) -> None:
        """Kill every sandbox and wait for its processes (the fake is going away)."""
        self.hang.set()
        sandboxes = self.listed()
        processes = [
            c.process for s in sandboxes for cs in s.sessions.values() for c in cs.values()
        ]
        for sandbox in sandboxes:
            self._remove(sandbox.sandbox_id)
        for process in processes:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(process.wait(), 5)
        shutil.rmtree(self.base_dir, ignore_errors=True)


async def _pump(command: FakeCommand) -> None:
    """Read both pipes into the command's chunks, then record its exit status."""
    process = command.process
    assert process.stdout is not None and process.stderr is not None

    async def read(stream: asyncio.StreamReader, name: str) -> None:
        while data := await stream.read(65536):
            command.append(name, data)

    await asyncio.gather(read(process.stdout, "stdout"), read(process.stderr, "stderr"))
    code = await process.wait()
    command.exit_code = code if code >= 0 else 128 - code
    command.changed.set()


def kill_group(process: asyncio.subprocess.Process, sig: int = signal.SIGKILL) -> None:
    """Signal the process group (each command is a session leader)."""
    if process.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)
