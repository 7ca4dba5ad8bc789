"""The spool: finished runs' outcomes the store could not take before the relay stopped.

A run that ends while the store refuses its final write keeps its outcome in memory and
retries (relay/runs/final_writes.py). A relay that stops meanwhile (SIGTERM, its drain
over, the store still down) writes those outcomes here instead of dropping them: one file
per run, ``<state dir>/spool/<run id>.json`` (the folder 0700, the files 0600: outputs may
be secret), each written whole to a temporary name, fsynced, renamed, and the folder
fsynced, so a reader sees a whole file or none. The next start of any relay that sees the
folder replays them into the store before its reaper marks anything ``lost``
(relay/runtime.py), and deletes each file once the store has it.

The spool is bounded: ``RELAY_SPOOL_MAX_BYTES`` for every file together. That much is kept
allocated on disk while the spool is empty (a file, ``reserve``, allocated at startup), and
each run's file takes its room from it as it is written (the reserve shrunk, the file
allocated at once, before anything else on the disk can take the blocks): a disk the
store's file filled still takes the outcomes. Each run keeps its output as far as the bound
allows: when all of it does not fit, each stream is cut to a fair share and marked
truncated, as the output caps do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relay.run_state import RunState
from relay.store.records import RunRecord, RunValues

log = logging.getLogger("relay.spool")

RESERVE = "reserve"
SUFFIX = ".json"
_FORMAT = 1
_STREAMS = ("stdout", "stderr")
_RUN_FIELDS = {field.name for field in dataclasses.fields(RunRecord)}
_LONG_REQUEST = 4096
"""A run's request echo longer than this is left out (the store has it already)."""


@dataclass(frozen=True)
class Spooled:
    """One run's outcome from the spool: the run as its relay knew it, and the final
    values its relay could not write."""

    run: RunRecord
    values: RunValues

    @property
    def final(self) -> RunRecord:
        return self.run.changed(**self.values)


class Spool:
    """The spool folder of one state directory."""

    def __init__(self, folder: Path, max_bytes: int) -> None:
        self.folder = folder
        self.max_bytes = max_bytes

    # -- while serving -------------------------------------------------------------------

    def reserve(self) -> None:
        """Keep the spool's room allocated on disk (less what the spool holds now). A
        disk too full for it is said once; the spool then takes what fits when needed."""
        try:
            self._make_folder()
            held = sum(path.stat().st_size for path in self._files())
            room = self.max_bytes - held
            reserve = self.folder / RESERVE
            if room <= 0:
                reserve.unlink(missing_ok=True)
                return
            if reserve.exists() and reserve.stat().st_size == room:
                return
            fd = os.open(reserve, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                os.ftruncate(fd, 0)
                os.posix_fallocate(fd, 0, room)
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning(
                "could not reserve the spool's room on disk (%s): outcomes a stopping "
                "relay must spool get what space is left",
                exc.strerror,
                extra={"path": str(self.folder)},
            )

    # -- at shutdown ---------------------------------------------------------------------

    def write(self, outcomes: Iterable[Spooled]) -> list[str]:
        """Write each outcome to its file, within the bound; the run ids written. Each is
        logged (id, state, exit code, output sizes); one that cannot be written is logged
        as lost. Called on the event loop's thread, so none of the relay's own store
        writes (the loop's) takes the reserve's blocks meanwhile."""
        entries = list(outcomes)
        if not entries:
            return []
        try:
            self._make_folder()
            block = max(512, os.statvfs(self.folder).f_bsize)
            others = sum(
                path.stat().st_size
                for path in self._files()
                if path.name.removesuffix(SUFFIX) not in {entry.run.id for entry in entries}
            )
        except OSError as exc:
            for entry in entries:
                _say(entry, "could not be spooled; its outcome is lost", logging.ERROR, exc)
            return []
        # Each file takes whole blocks: room for the rounding is kept aside.
        budget = max(0, self.max_bytes - others - len(entries) * block)
        written = []
        for entry in _within(entries, budget):
            data = json.dumps(_encoded(entry), separators=(",", ":")).encode()
            try:
                self._take_from_reserve(-(-len(data) // block) * block)
                self._write_one(entry.run.id, data)
            except OSError as exc:
                _say(entry, "could not be spooled; its outcome is lost", logging.ERROR, exc)
                continue
            _say(entry, "spooled: the store did not take its outcome", logging.WARNING)
            written.append(entry.run.id)
        return written

    def _take_from_reserve(self, size: int) -> None:
        """Free ``size`` bytes of the reserve (all of it when it holds less)."""
        reserve = self.folder / RESERVE
        with contextlib.suppress(FileNotFoundError):
            held = reserve.stat().st_size
            if held > size:
                os.truncate(reserve, held - size)
            else:
                reserve.unlink()

    def _write_one(self, run_id: str, data: bytes) -> None:
        path = self.folder / f"{run_id}{SUFFIX}"
        temporary = path.with_name(f".{path.name}.part")
        fd = os.open(
            temporary,
            os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW,
            0o600,
        )
        try:
            os.posix_fallocate(fd, 0, len(data))  # the blocks the reserve just gave up
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            temporary.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(temporary, path)
        self._sync_folder()

    # -- at the next start ---------------------------------------------------------------

    def load(self, skip: Iterable[str] = ()) -> list[Spooled]:
        """The outcomes in the spool (but those of ``skip``); an unreadable file is named
        in a log line and left for the operator: one that is not a regular file (a link, a
        FIFO: never opened so that a start could block), not a spooled outcome's JSON, or
        naming another run than its file name does (replayed, it would finish that run)."""
        skipped = set(skip)
        found = []
        for path in self._files():
            run_id = path.name.removesuffix(SUFFIX)
            if run_id in skipped:
                continue
            try:
                spooled = _decoded(json.loads(_read_regular(path)))
                if spooled.run.id != run_id:
                    raise ValueError("the file names another run than its own name does")
                found.append(spooled)
            except (OSError, ValueError, TypeError, KeyError) as exc:
                log.error(
                    "a spool file could not be read; left in place",
                    extra={"path": str(path), "error_class": type(exc).__name__},
                )
        return found

    def remove(self, run_id: str) -> None:
        """The store has the run's outcome (or it was final already): its file goes."""
        with contextlib.suppress(OSError):
            (self.folder / f"{run_id}{SUFFIX}").unlink()
            self._sync_folder()

    # -- the folder ----------------------------------------------------------------------

    def _files(self) -> list[Path]:
        try:
            return sorted(
                path
                for path in self.folder.iterdir()
                if path.name.endswith(SUFFIX) and not path.name.startswith(".")
            )
        except FileNotFoundError:
            return []

    def _make_folder(self) -> None:
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.folder, 0o700)  # outputs may be secret, whatever the umask made it

    def _sync_folder(self) -> None:
        fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _read_regular(path: Path) -> bytes:
    """The bytes of the regular file at ``path``: a link is not followed, and a FIFO or a
    device is refused without blocking (none is what a relay spools)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        return file.read()


def _say(entry: Spooled, what: str, level: int, exc: OSError | None = None) -> None:
    final = entry.final
    log.log(
        level,
        "run %s %s",
        final.id,
        what,
        extra={
            "run_id": final.id,
            "state": final.state,
            "exit_code": final.exit_code,
            "stdout_bytes": len(final.stdout.encode()),
            "stderr_bytes": len(final.stderr.encode()),
            **({"error_class": type(exc).__name__} if exc is not None else {}),
        },
    )


def _within(entries: list[Spooled], max_bytes: int) -> list[Spooled]:
    """``entries`` with their output cut to fit ``max_bytes`` together (the whole of it
    when it fits): each stream gets an equal share of the room the runs' other fields
    leave, a stream shorter than its share giving the rest to the others."""
    sizes = [len(json.dumps(_encoded(entry))) for entry in entries]
    if sum(sizes) <= max_bytes:
        return entries
    bare = [_without_output(entry) for entry in entries]
    room = max_bytes - sum(len(json.dumps(_encoded(entry))) for entry in bare)
    streams = [
        (index, name, len(json.dumps(entry.values.get(name, ""))))
        for index, entry in enumerate(entries)
        for name in _STREAMS
    ]
    shares = _fair_shares([size for _, _, size in streams], max(0, room))
    cut: list[dict[str, Any]] = [dict(entry.values) for entry in entries]
    for (index, name, size), share in zip(streams, shares, strict=True):
        if share < size:
            text = str(cut[index].get(name, ""))
            cut[index][name] = _cut(text, share)
            cut[index][f"{name}_truncated"] = True
    return [
        Spooled(entry.run, RunValues(**values))  # type: ignore[typeddict-item]
        for entry, values in zip(entries, cut, strict=True)
    ]


def _fair_shares(sizes: list[int], room: int) -> list[int]:
    """Water-filling: each size gets at most an equal share of ``room``; what a smaller one
    leaves is shared by the rest."""
    shares = [0] * len(sizes)
    left = room
    order = sorted(range(len(sizes)), key=lambda index: sizes[index])
    for position, index in enumerate(order):
        share = left // (len(order) - position)
        shares[index] = min(sizes[index], share)
        left -= shares[index]
    return shares


def _cut(text: str, encoded_bytes: int) -> str:
    """The head of ``text`` whose JSON form takes at most ``encoded_bytes``."""
    if encoded_bytes <= 2:
        return ""
    size = len(json.dumps(text))
    kept = text[: max(0, int(len(text) * (encoded_bytes - 2) / max(size - 2, 1)))]
    while kept and len(json.dumps(kept)) > encoded_bytes:
        kept = kept[: len(kept) * 9 // 10]
    return kept


def _without_output(entry: Spooled) -> Spooled:
    values = dict(entry.values)
    for name in _STREAMS:
        values[name] = ""
    return Spooled(entry.run, RunValues(**values))  # type: ignore[typeddict-item]


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, RunState) else value


def _encoded(entry: Spooled) -> dict[str, Any]:
    run = {name: _plain(value) for name, value in vars(entry.run).items()}
    for name in entry.values:
        run.pop(name, None)  # the values carry it (the output, above all: once)
    if len(run.get("request") or "") > _LONG_REQUEST:
        run["request"] = None
    values = {name: _plain(value) for name, value in entry.values.items()}
    return {"format": _FORMAT, "run": run, "values": values}


def _decoded(document: Any) -> Spooled:
    if not isinstance(document, dict) or not all(
        isinstance(document.get(part), dict) for part in ("run", "values")
    ):
        raise TypeError("not a spooled outcome")
    if document.get("format") != _FORMAT:
        raise ValueError(f"spool format {document.get('format')!r}")
    fields = {name: value for name, value in document["run"].items() if name in _RUN_FIELDS}
    values = {name: value for name, value in document["values"].items() if name in _RUN_FIELDS}
    if "state" in values:
        values["state"] = RunState(values["state"])
    run = RunRecord(**{**fields, **values})
    return Spooled(run, RunValues(**values))  # type: ignore[typeddict-item]
