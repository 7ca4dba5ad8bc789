"""A local sandbox's files read after its command ended, inside the sandbox's own view.

With bubblewrap a sandbox's ``/workspace`` and ``/tmp`` are tmpfs mounts in the mount
namespace bwrap made, gone with its last process. So before the job starts (a setup step,
with bwrap's child pid) the relay opens that child's user and mount namespaces and holds
them (:class:`View`): the mounts outlive the command, until the sandbox is terminated.

A read then runs a host program *inside* those namespaces (``nsenter --user --mount``,
which also makes the namespace's root the program's root): ``find`` lists a folder without
following links (``%y`` tells a file, a folder, a link and a special file apart), ``dd``
reads a file with ``iflag=nofollow`` up to a byte count. Every path is resolved in the
sandbox's view, never on the host: a link the job made to ``/etc/shadow`` names the
sandbox's own ``/etc`` (and is not followed anyway), and no host path of the sandbox's is
ever opened by the relay. The job's processes are gone by then (its PID namespace ended
with the command), so nothing changes the files between the listing and the read.

Without bubblewrap (``RELAY_LOCAL_ISOLATION=none``, no security boundary) the same
programs run on the sandbox's host folder.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Sequence

from relay.errors import FileUnreadable, ProviderError
from relay.providers.collection import find_entries, find_listing
from relay.providers.contract import FileEntry
from relay.providers.local.invocation import HOST_ENV

READ_CHUNK = 65_536
MAX_LISTING_BYTES = 4 * 1_048_576
"""Most of a folder's listing read (about 100,000 names); the rest of a larger folder is
not seen."""
LIST_TIMEOUT_S = 10.0


class View:
    """The namespaces of a sandbox's last command, held open so its mounts outlive it."""

    def __init__(self, pid: int) -> None:
        self.user = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        try:
            self.mount = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            os.close(self.user)
            raise

    def prefix(self, nsenter: str) -> list[str]:
        """The command that runs what follows it in the sandbox's view."""
        return [
            nsenter,
            f"--user=/proc/self/fd/{self.user}",
            f"--mount=/proc/self/fd/{self.mount}",
            "--preserve-credentials",
            "--",
        ]

    def close(self) -> None:
        for fd in (self.user, self.mount):
            with contextlib.suppress(OSError):
                os.close(fd)


def read_command(path: str, limit: int) -> list[str]:
    return [
        "dd",
        f"if={path}",
        "iflag=nofollow,count_bytes",
        f"bs={READ_CHUNK}",
        f"count={limit}",
        "status=none",
    ]


async def listed(prefix: Sequence[str], path: str, fds: Sequence[int]) -> list[FileEntry]:
    """The entries of the folder at ``path`` (in the view of ``prefix``)."""
    process = await _start([*prefix, *find_listing(path)], fds)
    assert process.stdout is not None
    try:
        async with asyncio.timeout(LIST_TIMEOUT_S):
            listing = await _read_up_to(process.stdout, MAX_LISTING_BYTES)
            more = await process.stdout.read(1)
            code = None if more else await process.wait()
    except TimeoutError as exc:
        raise ProviderError("listing a sandbox folder took too long") from exc
    finally:
        await _end(process)
    if code not in (0, None):
        raise FileUnreadable("no such folder")
    return find_entries(listing)


async def _read_up_to(stream: asyncio.StreamReader, limit: int) -> bytes:
    """Up to ``limit`` bytes of ``stream``, fewer only at its end (one ``read(limit)``
    returns what the pipe holds at the moment: about 64 KiB of a long listing)."""
    chunks: list[bytes] = []
    left = limit
    while left > 0 and (chunk := await stream.read(min(left, READ_CHUNK))):
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


async def read(
    prefix: Sequence[str], path: str, limit: int, fds: Sequence[int]
) -> AsyncIterator[bytes]:
    """The first ``limit`` bytes of the regular file at ``path``, in chunks."""
    process = await _start([*prefix, *read_command(path, limit)], fds)
    assert process.stdout is not None
    try:
        while chunk := await process.stdout.read(READ_CHUNK):
            yield chunk
        if await process.wait() != 0:
            raise FileUnreadable("the file could not be read")
    finally:
        await _end(process)


async def _start(argv: list[str], fds: Sequence[int]) -> asyncio.subprocess.Process:
    try:
        return await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            env=HOST_ENV,
            pass_fds=tuple(fds),
        )
    except OSError as exc:
        raise ProviderError(f"could not read the sandbox's files: {exc.strerror}") from exc


async def _end(process: asyncio.subprocess.Process) -> None:
    """The reader ended (killed if it is still running: a cap reached, a deadline)."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
    with contextlib.suppress(ProcessLookupError):
        await asyncio.shield(process.wait())
