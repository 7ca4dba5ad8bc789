"""Finding a run's declared files in its sandbox, through the provider's own file API.

A job declares paths and globs relative to its workdir (``out/report.json``, ``out/*.png``);
:func:`found_files` walks them one folder level at a time over :meth:`Sandbox.list_folder`
and yields each match as a :class:`Found`: a file to read (its absolute path in the sandbox
and listed size), or an entry that will not be read and why. What it holds to, on every
provider:

- a link is never followed, at any level (a folder reached through a link is not entered,
  a matched link is listed as skipped), and a device, FIFO or socket is never opened;
- a name is checked before it becomes part of a path the relay keeps: not ``.`` nor
  ``..`` (which a hostile file API may list), no ``/``, NUL, control characters or
  characters that reorder text (a name shown as another), valid UTF-8, at most 255 bytes
  (the whole path 1024), and normalised to Unicode NFC (two files whose names normalise
  alike are one artifact, the first);
- ``*``, ``?`` and ``[...]`` match within one name and match a leading ``.`` only when the
  pattern has one (the shell's rule); the walk is sorted, so the same files give the same
  list, and each folder is listed once;
- at most ``max_files`` files are yielded for reading and at most ``max_files`` more
  entries as skipped; past those, one entry per pattern counts what else matched, so
  10,000 matches cost a listing, not 10,000 entries;
- at most :data:`MAX_WALK_NAMES` names are listed in all (past them, an entry per pattern
  says the walk stopped).

Reading a file, and the byte caps, are the caller's (relay/runs/artifacts.py).
"""

from __future__ import annotations

import fnmatch
import posixpath
import unicodedata
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace

from relay.errors import FileUnreadable
from relay.providers.contract import DEFAULT_WORKDIR, FileEntry, FileKind, Sandbox

GLOB_CHARACTERS = frozenset("*?[")
"""What makes a name in a declared path a pattern (``fnmatch``'s), not a literal name."""
MAX_NAME_BYTES = 255
MAX_PATH_BYTES = 1024
BIDI_CONTROLS = frozenset(
    "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
)
"""Characters that reorder the text around them: in a name they make ``invoice\u202egnp.exe``
show as ``invoiceexe.png`` wherever it is drawn (the console, a download's file name)."""
MAX_WALK_NAMES = 100_000
"""Most names one collection lists, over all its folders: the listings are held until it
ends, so a job's million files (hard links cost its tmpfs nothing) cost the relay tens of
megabytes, not hundreds. Past it no further folder is listed, and the patterns left say so."""
SPENT = f"the run's folders hold more than {MAX_WALK_NAMES} names: not all were looked at"
LINK = "a symbolic link (links are not followed)"
SPECIAL = "not a regular file (a device, FIFO or socket is never opened)"


@dataclass(frozen=True)
class Found:
    """One entry of a run's artifacts: a file to read, or why one is not read."""

    name: str
    """Its path relative to the workdir, normalised; for an entry about a whole pattern
    (nothing matched, more matched than kept), the pattern."""
    path: str | None = None
    """Where it is in the sandbox (absolute, with the names as listed): set for a file to
    read, ``None`` for a skipped one."""
    size: int | None = None
    """Its size as listed (``None``: the provider does not say)."""
    skipped: str | None = None
    """Why it is not read (``None``: it is to be read)."""


_FIND_KINDS: dict[str, FileKind] = {"f": "file", "d": "folder", "l": "link"}


def find_listing(path: str) -> list[str]:
    """A command that lists the folder at ``path`` for :func:`find_entries`, links not
    followed (``%y``: the entry's own type), NUL-separated: for a provider whose file API
    has no listing of its own, run in the sandbox (GNU find)."""
    return ["find", path, "-mindepth", "1", "-maxdepth", "1", "-printf", "%y %s %f\\0"]


def find_entries(listing: bytes) -> list[FileEntry]:
    """The records of :func:`find_listing`'s output as entries (a record cut short, at
    the end of a capped listing, is left out; a name not UTF-8 keeps its bytes escaped,
    which :func:`name_problem` refuses)."""
    found = []
    for record in listing.split(b"\0"):
        kind, _, rest = record.partition(b" ")
        size, _, name = rest.partition(b" ")
        if not name or not size.isdigit():
            continue
        found.append(
            FileEntry(
                name.decode("utf-8", "surrogateescape"),
                _FIND_KINDS.get(kind.decode("ascii", "replace"), "other"),
                int(size),
            )
        )
    return found


def folder_of(workdir: str | None) -> str:
    """The absolute folder the declared paths are relative to, as every provider places a
    run's workdir (relative to :data:`DEFAULT_WORKDIR`)."""
    return posixpath.normpath(posixpath.join(DEFAULT_WORKDIR, workdir or "."))


def is_glob(part: str) -> bool:
    return not GLOB_CHARACTERS.isdisjoint(part)


def matches(part: str, name: str) -> bool:
    """Whether ``name`` matches one name of a pattern (a hidden name only when asked for)."""
    if name.startswith(".") and not part.startswith("."):
        return False
    return fnmatch.fnmatchcase(name, part)


def shown(name: str) -> str:
    """``name`` as text safe to store and show: control characters and undecodable bytes
    replaced, cut to 255 characters."""
    text = name.encode("utf-8", "replace").decode("utf-8")
    return "".join("\ufffd" if _unshowable(char) else char for char in text)[:MAX_NAME_BYTES]


def name_problem(name: str) -> str | None:
    """Why a listed name cannot be an artifact's, or ``None`` (a sandbox names its own
    files: any of these can come from a hostile job or a provider's API)."""
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "its name is not UTF-8 text"
    if "/" in name or "\x00" in name or name in (".", ".."):
        return "its name is not a file name (a / or NUL in it, or . or ..)"
    if any(_control(char) for char in name):
        return "its name has control characters"
    if not BIDI_CONTROLS.isdisjoint(name):
        return "its name has characters that reorder text"
    if size > MAX_NAME_BYTES:
        return f"its name is over {MAX_NAME_BYTES} bytes"
    return None


def _control(char: str) -> bool:
    return unicodedata.category(char) in ("Cc", "Cs")


def _unshowable(char: str) -> bool:
    return _control(char) or char in BIDI_CONTROLS


class _Walk:
    """One collection's walk: each folder listed at most once, names seen once."""

    def __init__(self, sandbox: Sandbox, root: str) -> None:
        self.sandbox = sandbox
        self.root = root
        self.listings: dict[str, list[FileEntry] | None] = {}
        self.names = 0
        """Names listed so far, in every folder (held until the walk ends)."""
        self.missed = False
        """A listing was cut, or a folder not listed, at :data:`MAX_WALK_NAMES`."""

    async def entries(self, folder: str) -> list[FileEntry] | None:
        """The folder's entries sorted by name; ``None`` where there is no folder (or the
        walk is spent)."""
        if folder not in self.listings:
            if self.names >= MAX_WALK_NAMES:
                self.missed = True
                return None
            try:
                listed = await self.sandbox.list_folder(folder)
            except FileUnreadable:
                self.listings[folder] = None
            else:
                kept = listed[: MAX_WALK_NAMES - self.names]
                self.names += len(kept)
                self.missed = self.missed or len(kept) < len(listed)
                self.listings[folder] = sorted(kept, key=lambda entry: entry.name)
        return self.listings[folder]

    async def matches(self, pattern: str) -> AsyncIterator[Found]:
        """What ``pattern`` matches, level by level, in order; for a literal path that is
        not a file, one entry saying why."""
        parts = pattern.split("/")
        level: list[tuple[str, str]] = [("", self.root)]  # (relative name, sandbox path)
        literal = not any(is_glob(part) for part in parts)
        for depth, part in enumerate(parts):
            last = depth == len(parts) - 1
            deeper: list[tuple[str, str]] = []
            for relative, folder in level:
                entries = await self.entries(folder)
                for entry in entries or []:
                    problem = name_problem(entry.name)
                    name = _normal(entry.name) if problem is None else entry.name
                    if not (matches(part, name) if is_glob(part) else name == _normal(part)):
                        continue
                    joined = f"{relative}/{name}" if relative else name
                    path = posixpath.join(folder, entry.name)
                    if problem is None and len(joined.encode()) > MAX_PATH_BYTES:
                        problem = f"its path is over {MAX_PATH_BYTES} bytes"
                    if problem is not None:
                        shown_name = (
                            f"{relative}/{shown(entry.name)}" if relative else shown(entry.name)
                        )
                        yield Found(shown_name, skipped=problem)
                    elif not last:
                        if entry.kind == "folder":
                            deeper.append((joined, path))
                        elif literal:
                            yield Found(
                                pattern, skipped=f"{joined} is {_kind(entry)}, not a folder"
                            )
                    elif entry.kind == "file":
                        yield Found(joined, path, entry.size)
                    elif entry.kind == "link":
                        yield Found(joined, skipped=LINK)
                    elif entry.kind == "other":
                        yield Found(joined, skipped=SPECIAL)
                    elif literal:
                        yield Found(joined, skipped="a folder, not a file")
            level = deeper


def _normal(name: str) -> str:
    return unicodedata.normalize("NFC", name)


def _kind(entry: FileEntry) -> str:
    return {"link": "a symbolic link", "file": "a file", "other": "a special file"}.get(
        entry.kind, "not a folder"
    )


async def found_files(
    sandbox: Sandbox, patterns: Sequence[str], *, workdir: str | None, max_files: int
) -> AsyncIterator[Found]:
    """Every entry of a run's artifacts, pattern by pattern (see the module's docstring):
    at most ``max_files`` files to read, at most ``max_files`` skipped entries, one entry per
    pattern that matched nothing, and one per pattern counting what matched past both caps.

    Provider errors (a sandbox that stopped answering) are raised to the caller, which
    keeps what it read before."""
    walk = _Walk(sandbox, folder_of(workdir))
    seen: set[str] = set()
    kept = noted = 0
    for pattern in patterns:
        matched = beyond = 0
        async for found in walk.matches(pattern):
            matched += 1
            if found.name in seen:
                continue  # matched by an earlier pattern too, or the same name after NFC
            seen.add(found.name)
            if found.skipped is None and kept < max_files:
                kept += 1
                yield found
                continue
            if found.skipped is None:
                found = replace(
                    found,
                    path=None,
                    skipped=f"past the cap of {max_files} files (RELAY_ARTIFACTS_MAX_FILES)",
                )
            if noted < max_files:
                noted += 1
                yield found
            else:
                beyond += 1
        if not matched:
            if walk.missed:
                yield Found(pattern, skipped=SPENT)
            elif is_glob(pattern):
                yield Found(pattern, skipped="no file matched")
            else:
                yield Found(pattern, skipped="not found")
        else:
            if beyond:
                yield Found(
                    pattern,
                    skipped=f"{beyond} more matches, neither kept nor listed (past twice "
                    f"RELAY_ARTIFACTS_MAX_FILES, {max_files})",
                )
            if walk.missed:
                yield Found(pattern, skipped=SPENT)
