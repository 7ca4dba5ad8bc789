"""The fake's ground truth and knobs: the ledger, the fault switches, the tokens it issued."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Faults:
    """Faults the next requests meet; ``reset()`` clears them all (and releases hangs)."""

    rate_limited: int = 0
    """The next N requests answer 429 (with :attr:`retry_after`) before reading the command."""
    retry_after: str | None = "1"
    """The Retry-After header of those 429s (None: no header)."""
    create_status: int | None = None
    """Every ``new`` answers this status (500, 429, 401...) without making a VM."""
    create_hang_before_allocating: bool = False
    """``new`` waits for the release (``reset()``) before making the VM, then answers."""
    create_hang: bool = False
    """``new`` makes the VM, then its answer never comes (until ``reset()``: a late answer)."""
    create_allocates_then_fails: bool = False
    """``new`` makes the VM (alive, tagged), then answers 500."""
    list_status: int | None = None
    """``ls`` answers this status."""
    list_hang: bool = False
    """``ls`` waits for the release before answering."""
    terminate_failures: int = 0
    """The next N ``rm`` requests answer 500 and delete nothing."""
    terminate_hang: bool = False
    """``rm`` waits for the release before deleting."""
    cut_stream: bool = False
    """``ssh`` answers end after their first output line, with no exit code."""
    vanish_after_s: float | None = None
    """VMs made now are deleted by the fake this long after creation."""
    stop_after_s: float | None = None
    """VMs made now are stopped (killed, not running) this long after creation."""
    commands_outlive_request: bool = False
    """A dropped ``ssh`` request leaves its command running (by default it is killed, as the
    SDK says closing the connection does; exe.dev's docs do not say)."""
    heartbeat_s: float = 30.0
    """A quiet ``ssh`` stream sends a blank line this often (the SDK: about every 30 s)."""

    def reset(self) -> None:
        fresh = Faults()
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(fresh, name))

    def take(self, name: str) -> bool:
        """Use up one of a counted fault (``rate_limited``, ``terminate_failures``)."""
        count: int = getattr(self, name)
        if count > 0:
            setattr(self, name, count - 1)
            return True
        return False


@dataclass(frozen=True)
class Token:
    """What an API token may do: as ``ssh-key generate-api-key --cmds --tag --exp`` sets."""

    label: str
    cmds: tuple[str, ...] | None = None
    """Command prefixes it may run (``"ls"``, ``"ssh my-vm"``); None: any command."""
    tag: str | None = None
    """It sees and manages only VMs with this tag, and VMs it creates get it."""
    expires_at: float | None = None
    """A time.time() after which it is refused (401)."""


@dataclass
class Ledger:
    """Ground truth: every create, delete, command and request, and the VMs that exist now."""

    created: list[dict[str, Any]] = field(default_factory=list)
    deleted: list[dict[str, Any]] = field(default_factory=list)
    commands: list[dict[str, Any]] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    """Every authorised request: ``{"verb", "token", "status"}`` (429s included)."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _existing: set[str] = field(default_factory=set)

    def record_create(self, entry: dict[str, Any]) -> None:
        with self.lock:
            self.created.append(entry)
            self._existing.add(entry["name"])

    def mark_gone(self, name: str, by: str) -> None:
        with self.lock:
            if name in self._existing:
                self._existing.discard(name)
                self.deleted.append({"name": name, "by": by, "at": time.time()})

    def alive(self) -> set[str]:
        """VMs not deleted: exe.dev bills a VM (its disk at least) until then."""
        with self.lock:
            return set(self._existing)

    def create_of(self, name: str) -> dict[str, Any] | None:
        with self.lock:
            return next((entry for entry in reversed(self.created) if entry["name"] == name), None)

    def tags_of(self, name: str) -> list[str]:
        entry = self.create_of(name)
        return [] if entry is None else list(entry["tags"])

    def verbs(self) -> list[str]:
        with self.lock:
            return [request["verb"] for request in self.requests]
