"""Sandboxes of the fake: a private directory each, commands as real local processes.

A sandbox's filesystem is a temp directory standing in for ``/``: ``/workspace/x`` lives
at ``<root>/workspace/x`` (see :mod:`testing.fakes.vercel.jail` for how commands see it).
Commands run in their own process group, with only the sandbox's and the command's
environment (never the host's), and are killed with their group on stop, expiry, destroy
or when the fake shuts down.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import os
import secrets
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testing.fakes.vercel.jail import host_path, launch

DEFAULT_CWD = "/vercel/sandbox"
MEMORY_PER_VCPU_MB = 2048


def now_ms() -> int:
    return int(time.time() * 1000)


class Signal:
    """An edge-triggered wake-up for readers waiting on new output or an ending."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def current(self) -> asyncio.Event:
        return self._event

    def fire(self) -> None:
        event, self._event = self._event, asyncio.Event()
        event.set()


@dataclass
class FakeCommand:
    """One command: its process, its output records, and how it ended."""

    id: str
    name: str
    args: list[str]
    cwd: str
    session_id: str
    started_at: int
    process: asyncio.subprocess.Process | None = None
    logs: list[dict[str, str]] = field(default_factory=list)
    exit_code: int | None = None
    lost: str | None = None
    """``stopped`` or ``vanished`` when the sandbox ended under the command."""
    stdin_written: int = 0
    stdin_attached: bool = False
    changed: Signal = field(default_factory=Signal)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def payload(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "name": self.name,
            "args": self.args,
            "cwd": self.cwd,
            "sessionId": self.session_id,
            "startedAt": self.started_at,
        }
        if self.exit_code is not None:
            body["exitCode"] = self.exit_code
        return body

    @property
    def done(self) -> bool:
        return self.exit_code is not None

    def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)


@dataclass
class FakeSandbox:
    """One named sandbox with its single session."""

    name: str
    project_id: str
    session_id: str
    root: Path
    timeout_ms: int
    tags: dict[str, str]
    env: dict[str, str]
    image: str | None
    vcpus: int
    network_policy: Any
    persistent: bool | None
    created_at: int = field(default_factory=now_ms)
    status: str = "running"
    stopped_at: int | None = None
    commands: dict[str, FakeCommand] = field(default_factory=dict)
    timers: list[asyncio.TimerHandle] = field(default_factory=list)

    def sandbox_payload(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "currentSessionId": self.session_id,
            "status": self.status,
            "projectId": self.project_id,
            "image": self.image,
            "memory": self.vcpus * MEMORY_PER_VCPU_MB,
            "vcpus": self.vcpus,
            "timeout": self.timeout_ms,
            "networkPolicy": self.network_policy,
            "tags": self.tags,
            "persistent": self.persistent,
            "cwd": DEFAULT_CWD,
            "region": "iad1",
            "createdAt": self.created_at,
            "updatedAt": self.created_at,
            "statusUpdatedAt": self.stopped_at or self.created_at,
        }

    def session_payload(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.session_id,
            "sourceSandboxName": self.name,
            "projectId": self.project_id,
            "status": self.status,
            "cwd": DEFAULT_CWD,
            "memory": self.vcpus * MEMORY_PER_VCPU_MB,
            "vcpus": self.vcpus,
            "timeout": self.timeout_ms,
            "networkPolicy": self.network_policy,
            "requestedAt": self.created_at,
            "startedAt": self.created_at,
        }
        if self.stopped_at is not None:
            body["stoppedAt"] = self.stopped_at
        return body

    def host_path(self, path: str, cwd: str = "/") -> Path:
        """Where a sandbox path lives on the host; refuses to leave the sandbox root."""
        return host_path(self.root, path, cwd)

    def stop(self, reason: str) -> None:
        """End the session: mark its commands lost, kill their process groups."""
        if self.status != "running":
            return
        self.status = "stopped"
        self.stopped_at = now_ms()
        for timer in self.timers:
            timer.cancel()
        for command in self.commands.values():
            if not command.done:
                command.lost = reason
            command.kill()
            command.changed.fire()

    def remove_files(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


async def start_command(
    box: FakeSandbox,
    *,
    name: str,
    args: list[str],
    cwd: str,
    env: dict[str, str],
    timeout_ms: int | None,
    attach_stdin: bool,
) -> FakeCommand:
    """Start a command as a real process in the sandbox (exit 127 if it can't start)."""
    command = FakeCommand(
        id=f"cmd_{secrets.token_hex(8)}",
        name=name,
        args=args,
        cwd=cwd,
        session_id=box.session_id,
        started_at=now_ms(),
        stdin_attached=attach_stdin,
    )
    box.commands[command.id] = command
    policy = box.network_policy if isinstance(box.network_policy, dict) else {}
    how = launch(box.root, [name, *args], cwd, isolate_network=policy.get("mode") == "deny-all")
    process_env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": how.home,
        "TMPDIR": how.tmp,
        "LANG": "C.UTF-8",
        **box.env,
        **env,
    }
    try:
        command.process = await asyncio.create_subprocess_exec(
            *how.argv,
            cwd=how.cwd,
            env=process_env,
            stdin=asyncio.subprocess.PIPE if attach_stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        command.logs.append({"stream": "stderr", "data": f"{name}: {exc.strerror}\n"})
        command.exit_code = 127
        return command
    command.tasks.append(asyncio.create_task(_follow(command, timeout_ms)))
    return command


async def _follow(command: FakeCommand, timeout_ms: int | None) -> None:
    process = command.process
    assert process is not None
    pumps = [
        asyncio.create_task(_pump(command, process.stdout, "stdout")),
        asyncio.create_task(_pump(command, process.stderr, "stderr")),
    ]
    try:
        if timeout_ms is None:
            code = await process.wait()
        else:
            try:
                code = await asyncio.wait_for(process.wait(), timeout_ms / 1000)
            except TimeoutError:
                command.kill()  # Vercel's command timeout kills with SIGKILL
                code = await process.wait()
        await asyncio.wait(pumps, timeout=1.0)
    finally:
        command.kill()
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
    command.exit_code = code if code >= 0 else 128 - code
    command.changed.fire()


async def _pump(command: FakeCommand, stream: asyncio.StreamReader | None, name: str) -> None:
    if stream is None:
        return
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    while chunk := await stream.read(65536):
        text = decoder.decode(chunk)
        if text:
            command.logs.append({"stream": name, "data": text})
            command.changed.fire()
    if tail := decoder.decode(b"", final=True):
        command.logs.append({"stream": name, "data": tail})
        command.changed.fire()


async def write_stdin(command: FakeCommand, data: bytes, offset: int, close: bool) -> None:
    """Deliver stdin bytes past what the process already has (offsets make resends safe)."""
    process = command.process
    if process is None or process.stdin is None:
        raise BrokenPipeError
    skip = max(0, command.stdin_written - offset)
    fresh = data[skip:]
    if fresh:
        process.stdin.write(fresh)
        await process.stdin.drain()
        command.stdin_written += len(fresh)
    if close:
        process.stdin.close()
