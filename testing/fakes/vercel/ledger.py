"""What the fake Vercel server saw and did, and the faults a test asks it to inject.

The ledger is written on the fake's own event-loop thread and read from the test's
thread, so every access goes through one lock.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Faults:
    """Faults the next requests will meet; ``reset()`` clears them all."""

    create_status: int | None = None
    """Every create answers this status (500, 429, 401...) without allocating."""
    create_hang: bool = False
    """Creates allocate the sandbox, then never answer."""
    create_allocates_then_fails: bool = False
    """Creates allocate the sandbox (alive, tagged), then answer 500."""
    cut_stream: bool = False
    """Run-command streams end after the first output record, with no final record."""
    terminate_failures: int = 0
    """The next N stop or destroy calls answer 500."""
    vanish_after_s: float | None = None
    """Sandboxes created now disappear this long after creation (killed, then 404)."""
    stop_after_s: float | None = None
    """Sandboxes created now have their session stopped this long after creation."""
    list_status: int | None = None
    """Listing sandboxes answers this status."""
    retry_after_s: int | str = 7
    """The ``Retry-After`` a 429 carries (text is sent as it is)."""

    def reset(self) -> None:
        fresh = Faults()
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(fresh, name))

    def take_terminate_failure(self) -> bool:
        """Consume one injected stop/destroy failure, if any is left."""
        if self.terminate_failures > 0:
            self.terminate_failures -= 1
            return True
        return False


@dataclass
class Ledger:
    """Ground truth: sandboxes, their create requests, stops, destroys and commands."""

    created: list[dict[str, Any]] = field(default_factory=list)
    """Each create body as received: name, lifetime, tags, network, resources, image, env names."""
    terminated: list[tuple[str, float]] = field(default_factory=list)
    """(sandbox name, time) when a sandbox stopped running, for whatever reason."""
    stops: list[str] = field(default_factory=list)
    destroys: list[str] = field(default_factory=list)
    commands: list[dict[str, Any]] = field(default_factory=list)
    """Each command request: sandbox, name, args, cwd, env names, sudo, timeout_ms."""
    tokens: set[str] = field(default_factory=set)
    """Every bearer token a request carried (to prove which credentials the SDK used)."""
    team_ids: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _running: set[str] = field(default_factory=set)
    _existing: set[str] = field(default_factory=set)

    def record_create(self, entry: dict[str, Any]) -> None:
        with self.lock:
            self.created.append(entry)

    def mark_running(self, name: str) -> None:
        with self.lock:
            self._running.add(name)
            self._existing.add(name)

    def mark_stopped(self, name: str) -> None:
        with self.lock:
            if name in self._running:
                self._running.discard(name)
                self.terminated.append((name, time.time()))

    def mark_gone(self, name: str) -> None:
        self.mark_stopped(name)
        with self.lock:
            self._existing.discard(name)

    def alive(self) -> set[str]:
        """Sandboxes whose session is running now (what a bill would count)."""
        with self.lock:
            return set(self._running)

    def existing(self) -> set[str]:
        """Sandboxes not destroyed, running or stopped."""
        with self.lock:
            return set(self._existing)

    def create_of(self, name: str) -> dict[str, Any] | None:
        with self.lock:
            for entry in self.created:
                if entry["name"] == name:
                    return entry
        return None

    def lifetime_of(self, name: str) -> float | None:
        entry = self.create_of(name)
        return None if entry is None else entry["lifetime_s"]

    def tags_of(self, name: str) -> dict[str, str]:
        entry = self.create_of(name)
        return {} if entry is None else dict(entry["tags"])
