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
from typing import Literal, get_args

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
    """Synchronous fan-out of :class:`RunEvent` to every subscriber (of its kind).

    A subscriber names the kinds it wants, or takes all: a run publishes a few `state`
    events and an output chunk each, which the metrics and the webhooks (only `finished`)
    need not be called for. Each kind's subscribers are a tuple, replaced on a change, so
    a publish iterates what was subscribed when it began (as a copy of a list did) without
    copying it each time."""

    def __init__(self) -> None:
        self._subscribers: list[tuple[Subscriber, frozenset[str] | None]] = []
        self._by_kind: dict[str, tuple[Subscriber, ...]] = {}
        self._refresh()

    def subscribe(
        self, subscriber: Subscriber, kinds: tuple[EventKind, ...] | None = None
    ) -> Callable[[], None]:
        """Call ``subscriber`` with each event of ``kinds`` (None: every event) from now on;
        returns the function that ends it."""
        entry = (subscriber, None if kinds is None else frozenset(kinds))
        self._subscribers.append(entry)
        self._refresh()

        def unsubscribe() -> None:
            if entry in self._subscribers:
                self._subscribers.remove(entry)
                self._refresh()

        return unsubscribe

    def _refresh(self) -> None:
        self._by_kind = {
            kind: tuple(
                subscriber
                for subscriber, kinds in self._subscribers
                if kinds is None or kind in kinds
            )
            for kind in get_args(EventKind)
        }

    def publish(self, event: RunEvent) -> None:
        for subscriber in self._by_kind[event.kind]:
            try:
                subscriber(event)
            except Exception as exc:
                log.error(
                    "event subscriber failed",
                    extra={"run_id": event.run_id, "error_class": type(exc).__name__},
                )
