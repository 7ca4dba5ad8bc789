"""SQLite WAL checkpoints on a thread of their own, never on the event loop.

The relay writes SQLite on the event-loop thread (relay/store/database.py). SQLite's automatic
checkpoint runs inside whichever commit crosses its threshold: it copies the WAL back into
the database file and syncs it, stalling every request for milliseconds; under load
that was the slowest percentile of the answers. The store turns it off
(``wal_autocheckpoint=0``) and this thread checkpoints instead, in PASSIVE mode (it never
blocks a reader or the writer), every ``every_s`` seconds; the driver releases the GIL
while it works.
"""

from __future__ import annotations

import logging
import sqlite3
import threading

log = logging.getLogger("relay.store")


class Checkpointer:
    """Checkpoints one SQLite file's WAL until :meth:`stop`."""

    def __init__(self, path: str, every_s: float = 0.5) -> None:
        self.path = path
        self.every_s = every_s
        self.done = 0
        self.blocked = 0  # a TRUNCATE kept from finishing by a write in progress
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="relay-checkpoint", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop, after one last checkpoint that also truncates the WAL file."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        connection = sqlite3.connect(self.path, timeout=1.0, check_same_thread=False)
        failing = False
        try:
            while not self._stop.wait(self.every_s):
                failing = self._checkpoint(connection, "PASSIVE", failing)
            self._checkpoint(connection, "TRUNCATE", failing)
        finally:
            connection.close()

    def _checkpoint(self, connection: sqlite3.Connection, mode: str, failing: bool) -> bool:
        try:
            busy, _, _ = connection.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
        except sqlite3.Error as exc:
            if not failing:  # once per run of failures: the WAL only grows meanwhile
                log.warning("WAL checkpoint failed", extra={"error_class": type(exc).__name__})
            return True
        if busy:  # SQLite answers rather than raises: the checkpoint did not finish
            self.blocked += 1
            return failing
        self.done += 1
        return False
