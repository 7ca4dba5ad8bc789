"""One job of the fake Worker: what it was asked, where it is, its output, its answer."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FINAL = frozenset({"exited", "timed_out", "canceled", "lost", "error"})
BUSY = frozenset({"starting", "running"})
"""States whose work goes on in the Worker's memory (a restart under them loses the job)."""


def iso(moment: float | None) -> str | None:
    """A time as JavaScript's ``toISOString()`` writes it."""
    if moment is None:
        return None
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(moment))
    return f"{seconds}.{int(moment * 1000) % 1000:03d}Z"


class Signal:
    """An edge-triggered wake-up for a stream waiting on new output or a new state."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def current(self) -> asyncio.Event:
        return self._event

    def fire(self) -> None:
        event, self._event = self._event, asyncio.Event()
        event.set()


@dataclass(eq=False)
class FakeJob:
    body: dict[str, Any]
    digest: str
    command: dict[str, Any] | None
    """From the create (one-shot) or the one run (two-step); None until then."""
    instance_type: str
    egress: tuple[str, list[str]]
    root: Path
    created_at: float
    deadline: float
    state: str = "starting"
    exit_code: int | None = None
    error: dict[str, str] | None = None
    started_at: float | None = None
    ended_at: float | None = None
    destroyed_at: float | None = None
    destroyed_by: str | None = None
    destroy_wanted: str | None = None
    """What first asked for the destroy (None: nothing yet)."""
    destroy_failures: int = 0
    run_digest: str | None = None
    keep: bool = False
    """A two-step job: its container outlives its command, until a DELETE or the alarm."""
    started: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once the container's start is over (up, or failed)."""
    events: list[dict[str, Any]] = field(default_factory=list)
    kept: dict[str, int] = field(default_factory=lambda: {"stdout": 0, "stderr": 0})
    truncated: dict[str, bool] = field(default_factory=lambda: {"stdout": False, "stderr": False})
    process: asyncio.subprocess.Process | None = None
    expired: bool = False
    """The command's own timeout killed it."""
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    timers: list[asyncio.TimerHandle] = field(default_factory=list)
    changed: Signal = field(default_factory=Signal)

    @property
    def id(self) -> str:
        return str(self.body["id"])

    @property
    def final(self) -> bool:
        return self.state in FINAL

    @property
    def busy(self) -> bool:
        return self.state in BUSY

    def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)

    def view(self) -> dict[str, Any]:
        """The job as ``GET /v1/jobs/{id}`` answers it (openapi.yaml, ``Job``)."""

        def text(stream: str) -> str:
            return "".join(event["data"] for event in self.events if event["type"] == stream)

        return {
            "id": self.id,
            "state": self.state,
            "exit_code": self.exit_code,
            "error": self.error,
            "stdout": text("stdout"),
            "stderr": text("stderr"),
            "stdout_truncated": self.truncated["stdout"],
            "stderr_truncated": self.truncated["stderr"],
            "events": len(self.events),
            "instance_type": self.instance_type,
            "egress": self.body["egress"],
            "tags": self.body["tags"],
            "timeout_s": self.body["timeout_s"],
            "grace_s": self.body["grace_s"],
            "created_at": iso(self.created_at),
            "deadline": iso(self.deadline),
            "started_at": iso(self.started_at),
            "ended_at": iso(self.ended_at),
            "destroyed_at": iso(self.destroyed_at),
            "destroyed_by": self.destroyed_by,
            "destroy_pending": self.destroyed_at is None and self.destroy_wanted is not None,
        }
