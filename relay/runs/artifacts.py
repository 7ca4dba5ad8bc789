"""A run's artifacts: the files its job declares, read from its sandbox before it ends.

The run task (relay/runs/run_task.py) calls :func:`collected` once, after the command ended
(succeeded, failed or timed out) and before it leaves the sandbox (which terminates it).
Collection then:

- finds the declared files through the provider's own file API (relay/providers/
  collection.py: links never followed, special files never opened, hostile names refused);
- reads each in chunks, straight into the store (relay/store/artifacts.py: content-addressed
  by SHA-256, chunked), so memory holds a chunk, never a file;
- holds to the caps (settings ``artifacts_max_file_bytes``, ``artifacts_max_run_bytes``,
  ``artifacts_max_files``): a file past the per-file or per-run cap is kept ``truncated``
  to its first bytes (``truncated_by`` names the cap), one found once the run's bytes are
  spent, or past the file count, is listed ``skipped`` with why;
- holds to the token's cap (``artifacts_max_token_bytes``, or the token's own
  ``max_artifact_bytes``): what its runs keep already is read from the store once, when a
  run has files to keep (:meth:`~relay.store.artifacts.Artifacts.token_bytes`, so it holds
  across replicas and is freed by ``relay prune``); a file that would take it past the cap
  is listed ``skipped``, never kept cut to fit. Runs of one token collecting at the same
  moment each count what was stored before them: together they may pass it by what those
  runs keep;
- is bounded in time: ``artifacts_collect_s``, never past the sandbox's hard lifetime
  (less a margin for its terminate); what is not read by then is listed as skipped;
- never fails the run by itself: a provider that stops answering ends the collection with
  what was read, and so does a cancel (a DELETE, the relay's shutdown) that comes while the
  files are read: what was kept is listed, the file being read skipped with why. Only a
  job with ``artifacts_required = true`` fails a run whose command succeeded when an
  artifact is missing, skipped or truncated.

The listing is written twice in one go: as ``run_artifacts`` rows (what a download and
retention look up) and as the run's ``artifacts`` column (what the run's JSON shows, with
no further query, relay/runs/view.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import mimetypes
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from relay.cancellation import finished_within
from relay.errors import FileUnreadable, ProviderError
from relay.providers.collection import Found, found_files
from relay.providers.contract import Sandbox
from relay.run_state import RunState, transition
from relay.runs.planning import Plan
from relay.settings import Settings
from relay.store.artifacts import Artifacts, BlobWriter, ObjectWriter, StoredArtifact
from relay.store.objects import StorageFailed
from relay.store.records import RunRecord, RunValues

log = logging.getLogger("relay.artifacts")

TERMINATE_MARGIN_S = 5.0
"""Left of a sandbox's hard lifetime for its terminate: collection ends before that."""
_TYPES = mimetypes.MimeTypes()  # Python's own table: the same answer on every host
OUT_OF_TIME = "collection ran out of time (RELAY_ARTIFACTS_COLLECT_S)"
ANSWERLESS = "the sandbox stopped answering while its files were read"
CUT_SHORT = "collection was cut short (the run was canceled, or the relay shut down)"


@dataclass(frozen=True)
class Caps:
    """What one run may keep (from the settings)."""

    file_bytes: int
    run_bytes: int
    files: int
    token_bytes: int | None = None
    """What the run's token may keep in all (None: no such cap, a collection made by hand)."""
    quota_name: str = "RELAY_ARTIFACTS_MAX_TOKEN_BYTES"
    """The cap's name, as a skipped file's reason says it."""

    @classmethod
    def of(cls, settings: Settings, plan: Plan | None = None) -> Caps:
        own = plan.artifacts_token_bytes if plan is not None else None
        return cls(
            settings.artifacts_max_file_bytes,
            settings.artifacts_max_run_bytes,
            settings.artifacts_max_files,
            int(own) if own is not None else settings.artifacts_max_token_bytes,
            "the token's max_artifact_bytes"
            if own is not None
            else "RELAY_ARTIFACTS_MAX_TOKEN_BYTES",
        )


def content_type(name: str) -> str:
    """The content type a name's extension says (``application/octet-stream`` if none)."""
    guessed, _ = _TYPES.guess_type(name, strict=False)
    return guessed or "application/octet-stream"


async def collected(
    sandbox: Sandbox,
    final: RunValues,
    *,
    plan: Plan,
    run: RunRecord,
    store: Artifacts | None,
    settings: Settings,
    lifetime_left_s: float,
    listed: RunValues | None = None,
) -> RunValues:
    """``final`` (the state the command ended in) with the run's artifacts: their listing,
    and ``failed`` where the job requires them whole and they are not. ``listed`` gets the
    listing as soon as it is recorded: a caller cancelled during the collection (a DELETE,
    the relay's shutdown) still holds the files kept so far there, the one being read
    listed as skipped with :data:`CUT_SHORT`, before the cancellation is raised."""
    if not plan.artifacts or store is None or not final:
        return final
    budget = min(settings.artifacts_collect_s, lifetime_left_s - TERMINATE_MARGIN_S)
    started = time.monotonic()
    entries: list[Entry] = []
    cancelled = False
    try:
        entries = await collect(
            sandbox, plan.artifacts, workdir=plan.workdir, store=store,
            caps=Caps.of(settings, plan), budget_s=budget, into=entries, token=run.token,
        )  # fmt: skip
    except asyncio.CancelledError:
        cancelled = True
    # Recorded to its end whatever cancels the caller meanwhile (also once the files are
    # all kept: a cancel that lands as the listing is written must not lose it).
    recording = asyncio.ensure_future(_recorded(run.id, entries, store, started))
    cancelled = await finished_within(recording, None) or cancelled
    if cancelled:
        try:
            listing = recording.result()
        except Exception as exc:  # the store: the cancel goes on, the run keeps its outcome
            log.warning(
                "artifacts: keeping a cut-short listing failed",
                extra={"run_id": run.id, "error_class": type(exc).__name__},
            )
        else:
            if listed is not None:
                listed["artifacts"] = listing
        raise asyncio.CancelledError
    listing = recording.result()
    if listed is not None:
        listed["artifacts"] = listing
    values: RunValues = {**final, "artifacts": listing}
    whole = all(entry.sha256 is not None and not entry.truncated for entry in entries)
    if plan.artifacts_required and not whole and final.get("state") == RunState.succeeded:
        incomplete = next(e for e in entries if e.sha256 is None or e.truncated)
        values |= {
            "state": transition(run, RunState.failed),
            "error_code": "artifacts_incomplete",
            "error_message": (
                f"the job requires its artifacts whole: {incomplete.name[:200]} "
                f"{'was truncated' if incomplete.truncated else 'was skipped'}"
            )[:500],
        }
    return values


async def _recorded(run_id: str, entries: Sequence[Entry], store: Artifacts, started: float) -> str:
    """Record the run's artifacts (rows and listing); the listing's JSON."""
    await store.record(run_id, [_stored(entry) for entry in entries])
    log.info(
        "artifacts collected",
        extra={
            "run_id": run_id,
            "kept": sum(entry.sha256 is not None for entry in entries),
            "bytes": sum(entry.size for entry in entries),
            "ms": int((time.monotonic() - started) * 1000),
        },
    )
    return listing_json(entries)


async def collect(
    sandbox: Sandbox,
    patterns: Sequence[str],
    *,
    workdir: str | None,
    store: Artifacts,
    caps: Caps,
    budget_s: float,
    into: list[Entry] | None = None,
    token: str | None = None,
) -> list[Entry]:
    """Find and keep the files ``patterns`` name in ``sandbox`` (see the module's
    docstring): each one's entry, in order (added to ``into`` as it is kept, where a
    cancelled caller finds them); nothing is raised for a file or a sandbox. With
    ``token`` (the run's), what it keeps already counts against ``caps.token_bytes``."""
    entries = [] if into is None else into
    if not getattr(sandbox, "reads_files", True):
        why = "this provider cannot read a sandbox's files yet"
        entries.extend(Entry(pattern, skipped=why) for pattern in patterns)
        return entries
    collection = _Collection(sandbox, store, caps, entries, token)
    await collection.run(patterns, workdir, budget_s)
    return entries


@dataclass(frozen=True)
class Entry:
    """One artifact of a run as collected (and as its JSON lists it)."""

    name: str
    size: int = 0
    sha256: str | None = None
    content_type: str = "application/octet-stream"
    truncated: bool = False
    truncated_by: str | None = None
    skipped: str | None = None


def listing_json(entries: Sequence[Entry]) -> str:
    return json.dumps([asdict(entry) for entry in entries], separators=(",", ":"))


def _stored(entry: Entry) -> StoredArtifact:
    return StoredArtifact(
        entry.name,
        entry.size,
        entry.sha256,
        entry.content_type,
        entry.truncated,
        entry.skipped or entry.truncated_by,
    )


class _Collection:
    """One run's collection: the entries so far and the bytes kept."""

    def __init__(
        self,
        sandbox: Sandbox,
        store: Artifacts,
        caps: Caps,
        entries: list[Entry],
        token: str | None = None,
    ) -> None:
        self.sandbox = sandbox
        self.store = store
        self.caps = caps
        self.entries = entries
        self.token = token
        self.total = 0
        self.stored: int | None = None
        """What the token kept before this run (read with the run's first file to keep)."""
        self.current: Found | None = None

    async def run(self, patterns: Sequence[str], workdir: str | None, budget_s: float) -> None:
        """Find and keep the files for at most ``budget_s``; what is not done by then (or
        when the sandbox stops answering) is listed as skipped."""
        try:
            async with asyncio.timeout(max(0.0, budget_s)):
                found = found_files(
                    self.sandbox, patterns, workdir=workdir, max_files=self.caps.files
                )
                async for entry in found:
                    self.current = entry
                    self.entries.append(await self._keep(entry))
                    self.current = None
        except TimeoutError:
            self._stopped(patterns, OUT_OF_TIME)
        except ProviderError as exc:
            log.warning("artifacts: provider error", extra={"error_code": exc.code})
            self._stopped(patterns, ANSWERLESS)
        except asyncio.CancelledError:
            self._stopped(patterns, CUT_SHORT)  # what was kept is listed all the same
            raise

    async def _not_stored(
        self, name: str, kind: str, writer: BlobWriter | ObjectWriter, exc: StorageFailed
    ) -> Entry:
        """The object storage did not take the file: listed as skipped (no listing names an
        object never stored), the run's result kept."""
        log.warning("artifacts: object storage failed", extra={"error": str(exc)[:200]})
        await writer.discard()
        return Entry(name, content_type=kind, skipped="the artifact storage did not take it")

    def _stopped(self, patterns: Sequence[str], why: str) -> None:
        """Name where the collection stopped: the file it was reading (or, between files,
        the first pattern); nothing after it was looked at."""
        name = self.current.name if self.current is not None else patterns[0]
        self.entries.append(Entry(name, skipped=f"{why}; nothing after it was looked at"))

    async def _token_left(self) -> int | None:
        """What the run's token may still keep (None: no token cap); the store is asked
        once per run, here, when the run has a file to keep."""
        if self.caps.token_bytes is None or self.token is None:
            return None
        if self.stored is None:
            self.stored = await self.store.token_bytes(self.token)
        return self.caps.token_bytes - self.stored - self.total

    async def _keep(self, found: Found) -> Entry:
        """The entry for ``found``: its bytes stored, up to the caps."""
        kind = content_type(found.name)
        if found.skipped is not None or found.path is None:
            return Entry(found.name, content_type=kind, skipped=found.skipped)
        caps, left = self.caps, self.caps.run_bytes - self.total
        if left <= 0:
            why = f"the run's artifacts reached RELAY_ARTIFACTS_MAX_RUN_BYTES ({caps.run_bytes})"
            return Entry(found.name, content_type=kind, skipped=why)
        room = min(caps.file_bytes, left)
        cap = (
            f"RELAY_ARTIFACTS_MAX_FILE_BYTES ({caps.file_bytes})"
            if room == caps.file_bytes
            else f"RELAY_ARTIFACTS_MAX_RUN_BYTES ({caps.run_bytes})"
        )
        token_left = await self._token_left()
        over = f"the token's stored artifacts would pass {caps.quota_name} ({caps.token_bytes})"
        if token_left is not None and (
            token_left < 0 or (found.size is not None and min(found.size, room) > token_left)
        ):
            return Entry(found.name, content_type=kind, skipped=over)
        writer = self.store.writer()
        # Past the token's room the file is skipped, not cut: read one byte more to tell.
        token_bound = token_left is not None and token_left < room
        if token_left is not None:
            room = min(room, token_left)
        kept, more = 0, False
        try:
            # One byte past the room tells a file cut at the cap from one that fits it.
            async for chunk in self.sandbox.read_file(found.path, room + 1, found.size):
                if kept + len(chunk) > room:
                    if token_bound:
                        await writer.discard()
                        return Entry(found.name, content_type=kind, skipped=over)
                    await writer.write(chunk[: room - kept])
                    kept, more = room, True
                    break
                await writer.write(chunk)
                kept += len(chunk)
        except FileUnreadable as exc:
            await writer.discard()
            return Entry(found.name, content_type=kind, skipped=exc.message)
        except StorageFailed as exc:
            return await self._not_stored(found.name, kind, writer, exc)
        except BaseException:
            await asyncio.shield(writer.discard())
            raise
        try:
            digest, size = await writer.finish()
        except StorageFailed as exc:
            return await self._not_stored(found.name, kind, writer, exc)
        self.total += size
        truncated = more or (found.size is not None and found.size > size)
        return Entry(
            found.name,
            size,
            digest,
            kind,
            truncated=truncated,
            truncated_by=cap if truncated else None,
        )
