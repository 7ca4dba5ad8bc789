"""The jobs folder as a running relay follows it: reloads that swap the whole catalog.

A reload (``SIGHUP``, ``POST /v1/jobs/reload`` behind ``relay jobs reload``, or the folder
watched with ``RELAY_JOBS_WATCH_S``) reads and checks the whole folder first, off the event
loop. A folder that does not load changes nothing: the last good catalog serves on, one log
line names the file and the problem, and :attr:`JobsFolder.problem` says it on ``/readyz``
until a reload succeeds. A folder that loads is swapped in whole, between two plans: a run
already planned keeps its plan (its argv, files, spec), the next one reads the new jobs.
Then the followers are told: the warm pools (a pool whose job changed shape or went away is
emptied, a new one fills) and ``/mcp`` (``notifications/tools/list_changed``).

Each replica holds its own catalog and reloads on its own signal or request.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from relay.cancellation import shielded
from relay.errors import ConfigError, JobsInvalid
from relay.runs.catalog import Catalog
from relay.settings import Settings

log = logging.getLogger("relay.jobs")

Follower = Callable[[Catalog], Awaitable[None]]
"""Told after each reload that changed something, with the catalog now serving."""


@dataclass(frozen=True)
class Reload:
    """What one reload did: the jobs now served, and how they differ from before."""

    jobs: tuple[str, ...]
    added: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    @property
    def changes(self) -> bool:
        return bool(self.added or self.changed or self.removed)


class JobsFolder:
    """The catalog in use, the folder it came from, and its reloads (one at a time)."""

    def __init__(self, settings: Settings, catalog: Catalog) -> None:
        self.settings = settings
        self.root = settings.jobs_dir
        self.catalog = catalog
        self.problem: str | None = None
        """Why the last reload failed (the file, relative to the folder, and what is wrong);
        None once one succeeds."""
        self._followers: list[Follower] = []
        self._lock = asyncio.Lock()
        self._seen: tuple[tuple[str, int, int], ...] | None = None

    def follow(self, follower: Follower) -> None:
        """Have ``follower`` told of every reload that changes the jobs."""
        self._followers.append(follower)

    async def reload(self) -> Reload:
        """Read the whole folder, and serve it if it loads; else raise :class:`JobsInvalid`
        (the last good jobs serve on). Reloads run one at a time, in the order asked."""
        async with self._lock:
            self._seen = await asyncio.to_thread(signature, self.root)
            try:
                fresh = await asyncio.to_thread(Catalog.load, self.root)
            except (ConfigError, OSError) as exc:
                message = exc.message if isinstance(exc, ConfigError) else _unreadable(exc)
                self.problem = self._relative(message)
                log.error("jobs reload failed, the last good jobs serve on: %s", _line(message))
                raise JobsInvalid(self.problem) from None
            # To the end once begun, whoever cancels the caller: pools half-followed would
            # keep sandboxes of a shape no run asks for any more.
            return await shielded(self._swap(fresh))

    async def _swap(self, fresh: Catalog) -> Reload:
        done = self._compare(fresh)
        self.catalog.swap(fresh)
        self.problem = None
        told = "".join(
            f"; {what} {', '.join(names)}"
            for what, names in (
                ("added", done.added),
                ("changed", done.changed),
                ("removed", done.removed),
            )
            if names
        )
        log.info("jobs reloaded: %d job(s)%s", len(done.jobs), told or "; nothing changed")
        for warning in done.warnings:
            log.warning(warning)
        if done.changes:
            await self._tell(self.catalog)
        return done

    def _compare(self, fresh: Catalog) -> Reload:
        old, new = self.catalog.jobs, fresh.jobs
        warm = sorted(set(self.settings.pool_warm) - set(new))
        return Reload(
            jobs=tuple(new),
            added=tuple(sorted(set(new) - set(old))),
            changed=tuple(sorted(name for name in set(new) & set(old) if new[name] != old[name])),
            removed=tuple(sorted(set(old) - set(new))),
            warnings=tuple(
                f"RELAY_POOL_WARM names job {name!r}, which the jobs folder no longer holds: "
                "no pool for it until it comes back"
                for name in warm
            ),
        )

    async def _tell(self, catalog: Catalog) -> None:
        for follower in self._followers:
            try:
                await follower(catalog)
            except Exception as exc:  # the jobs are swapped; a follower catches up later
                log.warning(
                    "following a jobs reload failed", extra={"error_class": type(exc).__name__}
                )

    def _relative(self, message: str) -> str:
        """The message with the folder's own path left out: it shows on ``/readyz``, which
        answers anyone, and names the file as ``NAME/job.toml``."""
        for prefix in {str(self.root), str(self.root.resolve())}:
            # Only where a path starts: the folder "jobs" is no part of "myjobs/job.toml".
            start = rf"(?<![\w./-]){re.escape(prefix.rstrip('/'))}"
            message = re.sub(start + "/", "", message)
            if os.path.isabs(prefix):  # the folder itself, missing
                message = re.sub(start + r"(?![\w./-])", "RELAY_JOBS_DIR", message)
        return _line(message)

    async def watch_forever(self, interval_s: float) -> None:
        """Reload whenever a file in the folder changes (``RELAY_JOBS_WATCH_S``): looked at
        every ``interval_s``, by the names, sizes and times of its files, off the event loop."""
        if self._seen is None:
            self._seen = await asyncio.to_thread(signature, self.root)
        while True:
            await asyncio.sleep(interval_s)
            seen = await asyncio.to_thread(signature, self.root)
            if seen == self._seen:
                continue
            try:
                await self.reload()
            except JobsInvalid:
                pass  # logged, and on /readyz; the next change is tried again
            except Exception as exc:  # the watch outlives whatever one look met
                log.warning("watching the jobs folder", extra={"error_class": type(exc).__name__})


def signature(root: Path) -> tuple[tuple[str, int, int], ...]:
    """Every file under ``root`` by relative path, size and modification time: what a
    change of the folder changes."""
    found: list[tuple[str, int, int]] = []
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            try:
                stat = os.stat(path)
            except OSError:
                continue  # removed meanwhile: the next look sees it gone
            found.append((os.path.relpath(path, root), stat.st_size, stat.st_mtime_ns))
    return tuple(sorted(found))


def _unreadable(exc: OSError) -> str:
    """A file gone or unreadable while the folder was read (it is being changed)."""
    return f"{exc.filename or 'a file'}: cannot be read ({exc.strerror or type(exc).__name__})"


def _line(message: str) -> str:
    return " ".join(message.split())
