"""One exe.dev VM as a run's sandbox: its files, and one command, started detached and
followed to its end (relay/providers/exedev/scripts.py says why and how)."""

from __future__ import annotations

import asyncio
import base64
import logging
import math
import posixpath
import secrets
import shlex
from collections.abc import AsyncIterator, Mapping, Sequence

from exedev import AsyncVM

from relay.errors import FileUnreadable, ProviderError, ProviderUnavailable, SandboxLost
from relay.providers.collection import find_entries, find_listing
from relay.providers.contract import (
    DEFAULT_WORKDIR,
    ExecResult,
    FileEntry,
    OutputSink,
    StreamName,
)
from relay.providers.exedev.scripts import (
    ENDED_WITHOUT_STATUS,
    FOLLOW,
    MISSING_TOOL,
    MONITOR,
    RUNNING,
    START,
    STATUS,
    UNPACK,
    archive_of,
)
from relay.providers.exedev.stream import STREAMS, Channel, follow
from relay.providers.lifecycle import (
    TIMEOUT_MARGIN_S,
    ProviderSandbox,
    SandboxOwner,
    variables_file,
)

log = logging.getLogger("relay.providers.exedev")

INLINE_BYTES = 16 * 1024
"""Inputs (the files' archive; a job's variables and stdin together) up to this size travel
as arguments of the command that uses them; larger ones are written to the VM first, in
parts (a request carries at most 64 KiB)."""
SCRIPT_TIMEOUT_S = 60.0
"""Bound on one of the relay's own scripts (writing files, starting the job)."""
MAX_LISTING_BYTES = 4 * 1_048_576
"""Most of a folder's listing read (about 100,000 names)."""
MAX_BARREN_FOLLOWS = 5
"""A command's stream that breaks this many times in a row without a byte is given up."""


class ExedevSandbox(ProviderSandbox):
    """A VM of the relay's, used for one run: named, tagged and deleted by the provider.

    Its files are read as exedev 0.4.0 offers: it has no listing, so a folder is listed by
    a ``find`` run in the VM (links not followed, each entry's own type and size); a file
    within the cap is ``vm.read_file`` (whole, base64 over ssh), a larger one ``head -c``
    with ``max_output`` at the cap."""

    def __init__(self, provider: SandboxOwner, vm: AsyncVM, channel: Channel) -> None:
        super().__init__(provider, vm.name)
        self._vm = vm
        self._channel = channel

    async def folder_entries(self, path: str) -> list[FileEntry]:
        listed = await self._vm.run(
            find_listing(path), timeout=SCRIPT_TIMEOUT_S, max_output=MAX_LISTING_BYTES
        )
        if listed.exit_code != 0:
            raise FileUnreadable("no such folder")
        return find_entries(listed.stdout_bytes)

    async def file_chunks(self, path: str, limit: int, size: int | None) -> AsyncIterator[bytes]:
        if size is not None and size <= limit:
            try:
                yield await self._vm.read_file(path)
            except (FileNotFoundError, IsADirectoryError) as exc:
                raise FileUnreadable("no such file") from exc
            return
        head = await self._vm.run(
            ["head", "-c", str(limit), "--", path], timeout=SCRIPT_TIMEOUT_S, max_output=limit
        )
        if head.exit_code != 0 and not head.stdout_bytes:
            raise FileUnreadable("the file could not be read")
        yield head.stdout_bytes

    async def write_files(self, files: Mapping[str, bytes]) -> None:
        if not files:
            return
        archive = archive_of(files)
        if len(archive) <= INLINE_BYTES:
            arguments = [base64.b64encode(archive).decode(), ""]
        else:
            path = f"/tmp/relay-files-{secrets.token_hex(8)}.tgz"  # noqa: S108 (in the VM)
            await self._vm.write_file(path, archive, mode=0o600)
            arguments = ["", path]
        code = await self._script(UNPACK, "relay-files", *arguments)
        if code != 0:
            raise ProviderError(f"the job's files could not be written in the VM (exit {code})")

    async def run(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None,
        env: Mapping[str, str],
        workdir: str | None,
        timeout_s: float,
        output: OutputSink,
    ) -> ExecResult:
        if not argv:
            raise ProviderError("there is no command to run")
        folder = f"/tmp/relay-run-{secrets.token_hex(8)}"  # noqa: S108 (in the VM)
        directory = posixpath.normpath(posixpath.join(DEFAULT_WORKDIR, workdir or "."))
        limit_s = math.ceil(timeout_s + TIMEOUT_MARGIN_S)
        variables, given = await self._inputs(folder, variables_file(env) if env else b"", stdin)
        code = await self._script(
            START, "relay-start", folder, variables, given, MONITOR, directory, str(limit_s), *argv
        )
        if code == MISSING_TOOL:
            raise ProviderError(
                "the job could not be started: the VM's image lacks setsid, flock, timeout or"
                " GNU tail, which the relay needs, or /tmp is not writable"
            )
        if code != 0:
            raise ProviderError(f"the job could not be started in the VM (exit {code})")
        return ExecResult(await self._follow(folder, output))

    async def _inputs(self, folder: str, variables: bytes, stdin: bytes | None) -> tuple[str, str]:
        """The variables and stdin as :data:`START` takes them: base64 on its line while
        small, else written to the run's folder first (mode 0600) and named ``-``."""
        if len(variables) + len(stdin or b"") <= INLINE_BYTES:
            return base64.b64encode(variables).decode(), base64.b64encode(stdin or b"").decode()
        if variables:
            await self._vm.write_file(f"{folder}/env", variables, mode=0o600)
        await self._vm.write_file(f"{folder}/in", stdin or b"", mode=0o600)
        return ("-" if variables else ""), "-"

    async def _script(self, script: str, name: str, *arguments: str) -> int:
        """Run one of the relay's scripts (``"$@"`` its arguments): its exit status."""
        command = ["sh", "-c", script, name, *arguments]
        result = await self._vm.run(command, timeout=SCRIPT_TIMEOUT_S, max_output=1 << 16)
        return result.exit_code

    async def _follow(self, folder: str, output: OutputSink) -> int:
        """Stream the job's output into ``output`` until it ends; its exit status. A stream
        that breaks is followed again from the bytes already received."""
        offsets: dict[StreamName, int] = dict.fromkeys(STREAMS, 0)
        skipping: set[StreamName] = set()
        barren = 0
        while True:
            where = ["end" if s in skipping else str(offsets[s]) for s in STREAMS]
            command = shlex.join(["sh", "-c", FOLLOW, "relay-follow", folder, *where])
            followed = await follow(self._channel, self.id, command, output, frozenset(skipping))
            for stream in STREAMS:
                offsets[stream] += followed.received[stream]
            if followed.exit_code is not None:
                if followed.exit_code == 255:
                    return await self._status(folder)
                return followed.exit_code
            if followed.capped is not None:
                skipping.add(followed.capped)  # left on purpose: follow on from its end
                continue
            progressed = any(followed.received.values())
            barren = 0 if progressed else barren + 1
            if await self.provider.gone(self.id):
                raise SandboxLost("the exe.dev VM was gone during the run")
            if barren >= MAX_BARREN_FOLLOWS:
                raise ProviderUnavailable("exe.dev's command stream kept breaking")
            log.info("exedev: command stream of VM %s broke; following it again", self.id)
            await asyncio.sleep(min(0.05 * 2**barren, 2.0))

    async def _status(self, folder: str) -> int:
        """The job's exit status after :data:`FOLLOW` exited 255 (the job's, or none)."""
        result = await self._vm.run(
            ["sh", "-c", STATUS, "relay-status", folder], timeout=SCRIPT_TIMEOUT_S
        )
        if result.exit_code == 0 and result.stdout.strip().isdigit():
            return int(result.stdout.strip())
        if result.exit_code == RUNNING:
            raise ProviderError("the job's output could not be followed in the VM")
        if result.exit_code == ENDED_WITHOUT_STATUS:
            raise SandboxLost("the job was killed with its exe.dev VM's processes")
        raise ProviderError(f"the job's status could not be read (exit {result.exit_code})")
