"""Whether the store is taking writes, and who to tell the moment it takes one again.

:class:`~relay.store.database.Store` marks each write (:meth:`StoreAnswer.failed` when the
database or its driver could not do it, :meth:`StoreAnswer.took` otherwise: a limit or a
duplicate key refused by the database is the database answering). Whoever waits out a
refusal with a backoff (the runner's final writes) listens, and tries again at once when
any write lands after a refusal, instead of sleeping out its delay. Reads do not count: a
SQLite file on a full disk still answers them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("relay.store")


class StoreAnswer:
    """The store's last answer to a write: refused or taken; listeners for its return."""

    def __init__(self) -> None:
        self.refusing = False
        self._listeners: list[Callable[[], None]] = []

    def listen(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (on the event loop, at once) each time a write is taken after
        one was refused."""
        self._listeners.append(listener)

    def failed(self) -> None:
        self.refusing = True

    def took(self) -> None:
        if not self.refusing:
            return  # the usual case: one attribute read per write
        self.refusing = False
        for listener in list(self._listeners):
            try:
                listener()
            except Exception:  # one listener's fault must not fail the write that landed
                log.exception("a listener of the store's return failed")
