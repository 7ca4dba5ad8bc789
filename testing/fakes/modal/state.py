"""The fake Modal's world: sandboxes, execs as real subprocesses, the ledger and the faults.

Everything here runs on the fake's own event loop (one background thread). The test thread
only reads the ledger, which guards its shared lists with a lock.
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
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import psutil

FS_TOOLS = "/__modal/.bin/modal-sandbox-fs-tools"
"""The helper binary the client execs for its filesystem API; the fake serves it in-process."""

BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
}
"""What a process sees besides its secrets: never the fake's (or the relay's) own environment."""


@dataclass
class Faults:
    """Failures the next calls suffer; ``reset()`` clears them all."""

    create_status: int | None = None
    create_hang: bool = False
    create_allocates_then_fails: bool = False
    cut_stream: bool = False
    terminate_failures: int = 0
    vanish_after_s: float | None = None

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]


class Ledger:
    """Ground truth for tests: what was created, what is alive, what was terminated."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.created: list[dict[str, Any]] = []
        self.terminated: list[tuple[str, float]] = []
        self.execs: list[dict[str, Any]] = []
        self.stream_cuts = 0
        self._alive: set[str] = set()

    def alive(self) -> set[str]:
        with self._lock:
            return set(self._alive)

    def record_create(self, entry: dict[str, Any]) -> None:
        with self._lock:
            self.created.append(entry)
            self._alive.add(entry["sandbox_id"])

    def record_exec(self, entry: dict[str, Any]) -> None:
        with self._lock:
            self.execs.append(entry)

    def record_end(self, sandbox_id: str, terminated: bool) -> None:
        with self._lock:
            self._alive.discard(sandbox_id)
            if terminated:
                self.terminated.append((sandbox_id, time.time()))

    def created_entry(self, sandbox_id: str) -> dict[str, Any] | None:
        with self._lock:
            for entry in self.created:
                if entry["sandbox_id"] == sandbox_id:
                    return entry
        return None


class Output:
    """One stream of a process: every byte kept, readable from any offset, long-pollable."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False
        self._changed = asyncio.Condition()

    async def append(self, chunk: bytes) -> None:
        async with self._changed:
            self.data.extend(chunk)
            self._changed.notify_all()

    async def close(self) -> None:
        async with self._changed:
            self.closed = True
            self._changed.notify_all()

    async def wait_beyond(self, offset: int) -> None:
        """Return once there are bytes past ``offset`` or the stream is closed."""
        async with self._changed:
            await self._changed.wait_for(lambda: len(self.data) > offset or self.closed)


@dataclass
class Exec:
    """One command in a sandbox: a real subprocess, or the in-process fs-tools helper."""

    exec_id: str
    argv: list[str]
    stdout: Output = field(default_factory=Output)
    stderr: Output = field(default_factory=Output)
    stdin_buffer: bytearray = field(default_factory=bytearray)
    stdin_closed: bool = False
    stdin_changed: asyncio.Event = field(default_factory=asyncio.Event)
    process: asyncio.subprocess.Process | None = None
    code: int | None = None
    signal: int | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    cut_pending: bool = False

    def kill(self) -> None:
        """Kill the process, its group and every descendant (a container dies whole)."""
        if self.process is None or self.process.returncode is not None:
            return
        try:  # children that called setsid() left the group but not the family tree
            family = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.Error:
            family = []
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        for member in family:
            with contextlib.suppress(psutil.Error):
                member.kill()


@dataclass
class SandboxState:
    """One fake sandbox: a private root directory standing in for its filesystem."""

    sandbox_id: str
    task_id: str
    app_id: str
    tags: dict[str, str]
    env: dict[str, str]
    timeout_secs: int
    created_at: float
    root: Path
    workdir: str
    execs: dict[str, Exec] = field(default_factory=dict)
    result: tuple[int, int] | None = None  # (GenericStatus, exitcode) once finished
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    vanished: bool = False
    timers: list[asyncio.TimerHandle] = field(default_factory=list)

    def host_path(self, path: str, cwd: str | None = None) -> Path:
        """Map a sandbox path (absolute, or relative to ``cwd``) under the sandbox root."""
        posix = PurePosixPath(cwd or self.workdir) / path
        parts = [part for part in posix.parts if part not in ("/", "", ".")]
        if ".." in parts:
            raise PermissionError("paths may not climb out of the sandbox")
        return self.root.joinpath(*parts)

    @property
    def running(self) -> bool:
        return self.result is None

    def stop(self, status: int, exitcode: int) -> None:
        """End the sandbox: kill every process, keep the record (and its result) for waits."""
        for timer in self.timers:
            timer.cancel()
        for ex in self.execs.values():
            ex.kill()
        if self.result is None:
            self.result = (status, exitcode)
        self.finished.set()

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def new_root(base: Path | None) -> Path:
    return Path(tempfile.mkdtemp(prefix="fake-modal-sb-", dir=base))
