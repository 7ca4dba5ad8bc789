"""In-process run events: state changes, output chunks, a route's failed attempts and the
final run.

The run service publishes; metrics, live output streams and webhooks subscribe. A
subscriber must be quick and must not raise (its errors are logged and dropped, so a
broken listener never breaks a run).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from relay.providers.contract import Attempt
from relay.store.records import RunRecord

log = logging.getLogger("relay.events")

EventKind = Literal["state", "output", "attempt", "finished"]


@dataclass(slots=True)
class RunEvent:
    """One thing that happened to a run (not to be changed by a subscriber; not frozen,
    which would make each of the several events of every run slower to make)."""

    run_id: str
    kind: EventKind
    state: str | None = None
    stream: str | None = None
    data: bytes = b""
    run: RunRecord | None = field(default=None, repr=False)
    """For ``finished``: the run as stored, final."""
    attempt: Attempt | None = None
    """For ``attempt``: a provider of the run's route that did not run it."""
    message: str = ""
    """For ``attempt``: what happened and where the run goes, in one line
    ("e2b: create timed out after 10 s; trying daytona")."""


Subscriber = Callable[[RunEvent], None]


class EventBus:
    """Synchronous fan-out of :class:`RunEvent` to every subscriber."""

    def __init__(self) -> None:
        self._subscribers: list[Subscriber] = []

    def subscribe(self, subscriber: Subscriber) -> Callable[[], None]:
        self._subscribers.append(subscriber)

        def unsubscribe() -> None:
            if subscriber in self._subscribers:
                self._subscribers.remove(subscriber)

        return unsubscribe

    def publish(self, event: RunEvent) -> None:
        for subscriber in list(self._subscribers):
            try:
                subscriber(event)
            except Exception as exc:
                log.error(
                    "event subscriber failed",
                    extra={"run_id": event.run_id, "error_class": type(exc).__name__},
                )
