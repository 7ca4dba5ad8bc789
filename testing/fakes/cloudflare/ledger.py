"""The fake Worker's ground truth and knobs: the ledger of jobs and the fault switches."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Faults:
    """Faults the next requests meet; ``reset()`` clears them all (and releases a hang)."""

    create_status: int | None = None
    """Every create answers this status (500, 503, 429 with Retry-After, 401...) and records
    nothing."""
    create_hang: bool = False
    """Creates record and start the job, then never answer (until ``reset()``)."""
    create_allocates_then_fails: bool = False
    """Creates record and start the job (listed, running), then answer 500."""
    cut_stream: bool = False
    """Event streams close after their first output line, with no ``end`` line."""
    terminate_failures: int = 0
    """The next N container destroys fail, whoever asks (a DELETE, the command's end, the
    alarm), as when Cloudflare's control plane does not answer: a DELETE then answers 202
    with ``destroy_pending``, the job stays listed and the fake retries every
    ``World.destroy_retry_s``."""
    vanish_after_s: float | None = None
    """Jobs created now are lost this long after creation: as when a rollout restarts the
    job's Durable Object under its command, the Worker reports ``lost`` and destroys it."""
    list_status: int | None = None
    """Listing answers this status."""
    timeout_ignored: bool = False
    """Commands started now outlive their ``timeout_s`` (a stuck exec that ignores its
    timeout, sandbox-sdk #438): only the deadline alarm ends them."""

    def reset(self) -> None:
        fresh = Faults()
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(fresh, name))

    def take_terminate_failure(self) -> bool:
        if self.terminate_failures > 0:
            self.terminate_failures -= 1
            return True
        return False


@dataclass
class Ledger:
    """Ground truth: every job created (its tags, size, egress), every container destroyed and
    by whom (``exit``, ``delete``, ``alarm``, ``lost``), every command, every key shown."""

    created: list[dict[str, Any]] = field(default_factory=list)
    destroyed: list[dict[str, Any]] = field(default_factory=list)
    commands: list[dict[str, Any]] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    """Every bearer key presented, in order (the right one included)."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _alive: set[str] = field(default_factory=set)

    def record_create(self, entry: dict[str, Any]) -> None:
        with self.lock:
            self.created.append(entry)
            self._alive.add(entry["id"])

    def record_destroy(self, job_id: str, by: str) -> None:
        with self.lock:
            if job_id in self._alive:
                self._alive.discard(job_id)
                self.destroyed.append({"id": job_id, "by": by, "at": time.time()})

    def alive(self) -> set[str]:
        """Jobs whose container is not destroyed: Cloudflare bills a container until then."""
        with self.lock:
            return set(self._alive)

    def create_of(self, job_id: str) -> dict[str, Any] | None:
        with self.lock:
            return next((entry for entry in self.created if entry["id"] == job_id), None)

    def tags_of(self, job_id: str) -> dict[str, str]:
        entry = self.create_of(job_id)
        return {} if entry is None else dict(entry["tags"])

    def lifetime_of(self, job_id: str) -> float | None:
        """The deadline the Worker's alarm enforces, in seconds after the create."""
        entry = self.create_of(job_id)
        return None if entry is None else float(entry["timeout_s"] + entry["grace_s"])

    def destroyed_by(self, job_id: str) -> str | None:
        with self.lock:
            return next((row["by"] for row in self.destroyed if row["id"] == job_id), None)
