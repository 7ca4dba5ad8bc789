"""An in-memory provider for tests and benchmarks (``RELAY_PROVIDERS=memory``).

Like httpx's ``MockTransport``, it ships so that anyone can test against it: it follows the
same lifecycle and passes the same contract as the real providers, costs nothing, and runs
no process. Two halves:

- :class:`MemoryWorld` is the provider's side, what a cloud's servers would be: every
  sandbox ever made and how it ended, each sandbox's hard lifetime, and the fault switches
  (:class:`MemoryFaults`, under the contract's fault names). It outlives any one client, so
  a test can play a relay process that died and a second one whose reaper cleans up.
- :class:`MemoryProvider` is one relay process's driver of a world, on the shared base:
  it maps the world's answers (:class:`MemoryAPIError`, a refused connection) through its
  error table like any SDK's.

A sandbox runs built-in commands only, never a program of the host: ``true``, ``false``,
``echo``, ``cat`` (its files or stdin), ``env``, ``sleep SECONDS``, ``exit CODE`` and
``sh -c "a; b >&2; echo x > out/a.txt; exit 3"`` (built-ins separated by ``;``, a trailing
``>&2`` sends one to stderr, ``> PATH`` writes an ``echo`` to a file). Anything else exits
127. A relay built from settings gets a world of its own. Its files are read back through
the world's file API (:meth:`MemoryWorld.folder`, :meth:`MemoryWorld.read`): folders are
implied by the paths of files, as in an object store.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import posixpath
import shlex
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import ClassVar

from relay.cancellation import Alarms
from relay.errors import (
    FileUnreadable,
    ProviderAuth,
    ProviderError,
    ProviderRateLimited,
    ProviderUnavailable,
    SandboxLost,
)
from relay.providers.contract import (
    DEFAULT_WORKDIR,
    TAG_CLUSTER,
    TAG_RUN,
    ExecResult,
    FileEntry,
    OutputSink,
    SandboxRef,
    SandboxSpec,
    StreamName,
)
from relay.providers.lifecycle import ErrorTable, ProviderSandbox, SandboxProvider
from relay.settings import Settings

API_KEY = "memory-key"
"""The one key a :class:`MemoryWorld` accepts; a provider with another is refused (401)."""
NOT_FOUND = 127
HISTORY = 1_000
"""Ended sandboxes a relay's own world remembers (:attr:`MemoryWorld.history`)."""
BODY_MARKER = "memory world:"
"""Starts every error body of the world, so a test can tell one never reaches a caller."""


class MemoryAPIError(Exception):
    """An answer of the world's API other than success, by HTTP status, like an SDK's."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"{status}: {BODY_MARKER} {body}")
        self.status = status


class PathMissing(MemoryAPIError):
    """The file API's 404 for a path the sandbox does not have (the sandbox itself is there)."""

    def __init__(self, path: str) -> None:
        super().__init__(404, f"no such file or folder: {path}")


class StreamCut(Exception):
    """A command's output stream broke; the command itself runs on (follow it again)."""


def _by_status(exc: BaseException) -> type[ProviderError] | None:
    status = getattr(exc, "status", None)
    if status in (401, 403):
        return ProviderAuth
    if status == 404:
        return SandboxLost
    if status == 429:
        return ProviderRateLimited
    if isinstance(status, int) and status >= 500:
        return ProviderUnavailable
    return None


ERRORS: ErrorTable = (
    (MemoryAPIError, _by_status),
    (ConnectionError, ProviderUnavailable),
)


@dataclass
class MemoryFaults:
    """Fault switches, under the contract's names; each holds until :meth:`MemoryWorld.reset`."""

    create_status: int | None = None
    """Every create answers this HTTP status without allocating anything."""
    create_hang: bool = False
    """Creates allocate, then never answer (the relay times out; the sandbox lives on)."""
    create_allocates_then_fails: bool = False
    """Creates allocate a tagged sandbox, then answer 503."""
    create_delay_s: float = 0.0
    """Every create takes this long, then succeeds."""
    cut_stream: bool = False
    """Each command's output stream breaks once, after its first chunk."""
    terminate_failures: int = 0
    """This many terminates answer 503 (each failure counts one down)."""
    vanish_after_s: float | None = None
    """Each sandbox that starts a command is killed this long after."""
    upload_hang: bool = False
    """Uploads never answer (a provider that stopped answering after the create)."""
    list_hang: bool = False
    """Listings never answer."""
    terminate_hang: bool = False
    """Terminates never answer (the sandbox lives on)."""
    upload_lost: bool = False
    """Each sandbox is gone when its files arrive (killed under the upload): 404."""


@dataclass
class Box:
    """One sandbox as the world knows it."""

    id: str
    run_id: str
    cluster: str
    creator: int
    lifetime_s: float
    tags: dict[str, str]
    created_at: float = field(default_factory=time.time)
    files: dict[str, bytes] = field(default_factory=dict)
    commands: set[Command] = field(default_factory=set)
    alive: bool = True
    ended_at: float | None = None
    ended_by: str | None = None
    """``run`` (the client that created it), ``reaper`` (another client), ``lifetime``,
    ``vanished`` (a fault)."""


@dataclass(eq=False)
class Command:
    """One command running in a box: its output so far and, once ended, its exit."""

    chunks: list[tuple[StreamName, bytes]] = field(default_factory=list)
    changed: asyncio.Event | None = None
    """Set on output or the end, once someone follows it (a built-in that ended at once
    is read whole: most commands never need one)."""
    ended: bool = False
    exit_code: int | None = None
    cut: bool = False
    task: asyncio.Task[None] | None = None
    error: Exception | None = None
    """What made a running command fail (a bad script): raised to whoever follows it."""

    def write(self, stream: StreamName, data: bytes) -> None:
        if data:
            self.chunks.append((stream, data))
            if self.changed is not None:
                self.changed.set()

    def end(self, exit_code: int | None) -> None:
        if not self.ended:
            self.ended, self.exit_code = True, exit_code
            if self.changed is not None:
                self.changed.set()


@dataclass
class MemoryWorld:
    """The provider's side: every sandbox ever made, how it ended, and the fault switches."""

    boxes: dict[str, Box] = field(default_factory=dict)
    faults: MemoryFaults = field(default_factory=MemoryFaults)
    reachable: bool = True
    """False: every call is a refused connection (a provider nobody listens for)."""
    started: list[tuple[str, str]] = field(default_factory=list)
    """(sandbox, run) of every command started, in order: a ledger of executions."""
    history: int | None = None
    """How many ended sandboxes (and started commands) it remembers, the oldest forgotten
    first; None: every one (a test's world). A relay's own world keeps
    :data:`HISTORY`: one that serves for days must not hold every sandbox it ever made,
    which the collector would scan again and again, more each run."""
    _ids: itertools.count[int] = field(default_factory=itertools.count)
    _ended: collections.deque[str] = field(default_factory=collections.deque)
    _release: asyncio.Event = field(default_factory=asyncio.Event)
    lifetimes: Alarms = field(default_factory=Alarms)
    """Each live box's hard lifetime (one timer of the loop's for all of them)."""

    def alive(self) -> set[str]:
        return {box.id for box in self.boxes.values() if box.alive}

    def created(self) -> list[str]:
        return list(self.boxes)

    def reset(self) -> None:
        """Disarm every fault and release the creates left hanging."""
        self.faults = MemoryFaults()
        self._release.set()
        self._release = asyncio.Event()

    # -- the API a driver calls -------------------------------------------------------------

    def _answer(self, api_key: str) -> None:
        if not self.reachable:
            raise ConnectionRefusedError("nothing listens for the memory world")
        if api_key != API_KEY:
            raise MemoryAPIError(401, "unknown key")

    def _box(self, box_id: str) -> Box:
        box = self.boxes.get(box_id)
        if box is None or not box.alive:
            raise MemoryAPIError(404, "no such sandbox")
        return box

    async def create(self, api_key: str, client: int, spec: SandboxSpec) -> Box:
        self._answer(api_key)
        faults = self.faults
        if faults.create_status is not None:
            raise MemoryAPIError(faults.create_status, "create refused")
        box = Box(
            f"mem-{next(self._ids)}", spec.run_id, spec.cluster, client, spec.lifetime_s, spec.tags
        )
        self.boxes[box.id] = box
        self.lifetimes.set(box.id, spec.lifetime_s, self.end, box.id, "lifetime")
        if faults.create_delay_s:
            await asyncio.sleep(faults.create_delay_s)
        if faults.create_hang:
            await self._release.wait()
            raise MemoryAPIError(503, "create abandoned")
        if faults.create_allocates_then_fails:
            raise MemoryAPIError(503, "create failed after allocating")
        return box

    def destroy(self, api_key: str, client: int, box_id: str) -> None:
        self._answer(api_key)
        if box_id not in self.boxes:
            raise MemoryAPIError(404, "no such sandbox")
        if self.faults.terminate_failures:
            self.faults.terminate_failures -= 1
            raise MemoryAPIError(503, "terminate failed")
        self.end(box_id, "run" if self.boxes[box_id].creator == client else "reaper")

    def extend(self, api_key: str, box_id: str, lifetime_s: float) -> None:
        """The box's hard lifetime ends ``lifetime_s`` from now (E2B's ``set_timeout``)."""
        self._answer(api_key)
        box = self._box(box_id)
        self.lifetimes.clear(box_id)
        box.lifetime_s = time.time() - box.created_at + lifetime_s
        self.lifetimes.set(box_id, lifetime_s, self.end, box_id, "lifetime")

    async def stalled(self, call: str) -> None:
        """A call the world does not answer until :meth:`reset` (then a 503)."""
        await self._release.wait()
        raise MemoryAPIError(503, f"{call} abandoned")

    def folder(self, api_key: str, box_id: str, path: str) -> list[tuple[str, bool, int]]:
        """The entries of a folder: ``(name, is_folder, size)``; :class:`PathMissing` when
        no file is under it."""
        self._answer(api_key)
        files = self._box(box_id).files
        prefix = path.rstrip("/") + "/"
        entries: dict[str, tuple[str, bool, int]] = {}
        for name, data in files.items():
            if name.startswith(prefix):
                first, _, rest = name[len(prefix) :].partition("/")
                entries[first] = (first, bool(rest), 0 if rest else len(data))
        if not entries:
            raise PathMissing(path)
        return list(entries.values())

    def read(self, api_key: str, box_id: str, path: str, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes of a file from ``offset`` (a ranged read, as S3's)."""
        self._answer(api_key)
        data = self._box(box_id).files.get(path)
        if data is None:
            raise PathMissing(path)
        return data[offset : offset + length]

    def list(self, api_key: str, cluster: str) -> list[Box]:
        self._answer(api_key)
        return [box for box in self.boxes.values() if box.alive and box.cluster == cluster]

    async def write(self, api_key: str, box_id: str, files: Mapping[str, bytes]) -> None:
        self._answer(api_key)
        if self.faults.upload_hang:
            await self._release.wait()
            raise MemoryAPIError(503, "upload abandoned")
        if self.faults.upload_lost:
            self.end(box_id, "vanished")
        self._box(box_id).files.update(files)

    def start(self, api_key: str, box_id: str, program: Program) -> Command:
        self._answer(api_key)
        box = self._box(box_id)
        self.started.append((box_id, box.run_id))
        command = Command()
        started = program(command)
        if isinstance(started, int):  # a built-in that ended at once: no task to wait for
            command.end(started)
        else:
            box.commands.add(command)
            command.task = asyncio.create_task(_ran(started, command))
            command.task.add_done_callback(lambda _: box.commands.discard(command))
        if self.faults.vanish_after_s is not None:
            asyncio.get_running_loop().call_later(
                self.faults.vanish_after_s, self.end, box_id, "vanished"
            )
        return command

    async def follow(self, command: Command, start: int) -> AsyncIterator[tuple[StreamName, bytes]]:
        """The command's output from chunk ``start`` on, to its end (may raise StreamCut)."""
        index = start
        while True:
            while index < len(command.chunks):
                yield command.chunks[index]
                index += 1
                if self.faults.cut_stream and not command.cut:
                    command.cut = True
                    raise StreamCut
            if command.ended:
                if command.error is not None:
                    raise command.error
                return
            # Nothing awaits between the checks above and this wait: no change is missed.
            if command.changed is None:
                command.changed = asyncio.Event()
            command.changed.clear()
            await command.changed.wait()

    def end(self, box_id: str, by: str) -> None:
        box = self.boxes.get(box_id)
        if box is None or not box.alive:
            return
        box.alive, box.ended_at, box.ended_by = False, time.time(), by
        self.lifetimes.clear(box_id)
        for command in list(box.commands):
            stop(command)
        if self.history is not None:
            self._forget(box_id)

    def _forget(self, ended: str) -> None:
        """Remember at most :attr:`history` ended sandboxes and started commands."""
        assert self.history is not None
        self._ended.append(ended)
        while len(self._ended) > self.history:
            self.boxes.pop(self._ended.popleft(), None)
        if len(self.started) > 2 * self.history:  # trimmed in halves: O(1) a command
            del self.started[: -self.history]


Program = Callable[[Command], "int | Awaitable[int]"]
"""A command: its exit code when it ends at once, else what to await for it."""


async def _ran(running: Awaitable[int], command: Command) -> None:
    try:
        command.end(await running)
    except asyncio.CancelledError:
        command.end(None)  # killed, as with its sandbox
    except Exception as exc:  # a bad script (`exit abc`, `sleep`): fails as a bad built-in
        command.error = exc
        command.end(None)


def stop(command: Command) -> None:
    """Kill a command (it ends with no exit status)."""
    if command.task is not None and not command.task.done():
        command.task.cancel()
    command.end(None)


class MemoryProvider(SandboxProvider["MemorySandbox"]):
    """One relay process's driver of a :class:`MemoryWorld` (a world of its own by default)."""

    name: ClassVar[str] = "memory"
    label: ClassVar[str] = "Memory"
    errors: ClassVar[ErrorTable] = ERRORS
    retry_after_s: ClassVar[float] = 1.0
    extends_lifetime: ClassVar[bool] = True

    _clients: ClassVar[itertools.count[int]] = itertools.count()

    def __init__(
        self, settings: Settings, world: MemoryWorld | None = None, *, api_key: str = API_KEY
    ) -> None:
        self.world = world if world is not None else MemoryWorld(history=HISTORY)
        self.cluster = settings.cluster
        self.create_timeout_s = settings.create_timeout_s
        self._api_key = api_key
        self._client = next(self._clients)

    def check(self, spec: SandboxSpec) -> None:
        """Everything is accepted: a built-in command reaches no network and uses no memory."""

    async def create(self, spec: SandboxSpec) -> MemorySandbox:
        box = await self.world.create(self._api_key, self._client, spec)
        return MemorySandbox(self, box.id)

    async def destroy(self, sandbox_id: str) -> None:
        if self.world.faults.terminate_hang:
            await self.world.stalled("terminate")
        self.world.destroy(self._api_key, self._client, sandbox_id)

    def destroy_now(self, sandbox_id: str) -> bool:
        """The world's terminate is a call in this process: it answers at once unless a
        fault holds it (then :meth:`destroy`, which waits)."""
        if self.world.faults.terminate_hang:
            return False
        self.world.destroy(self._api_key, self._client, sandbox_id)
        return True

    async def extend_lifetime(self, sandbox_id: str, lifetime_s: int) -> None:
        self.world.extend(self._api_key, sandbox_id, lifetime_s)

    async def list_tagged(self) -> list[SandboxRef]:
        if self.world.faults.list_hang:
            await self.world.stalled("list")
        return [
            SandboxRef(box.id, box.tags.get(TAG_RUN), datetime.fromtimestamp(box.created_at, UTC))
            for box in self.world.list(self._api_key, self.cluster)
            if box.tags.get(TAG_CLUSTER) == self.cluster
        ]


class MemorySandbox(ProviderSandbox):
    """A sandbox of the memory world, valid inside :meth:`MemoryProvider.sandbox`."""

    provider: MemoryProvider

    async def write_files(self, files: Mapping[str, bytes]) -> None:
        absolute = {_absolute(DEFAULT_WORKDIR, path): data for path, data in files.items()}
        await self.provider.world.write(self.provider._api_key, self.id, absolute)

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
        world = self.provider.world
        box = world.boxes[self.id]
        shell = Shell(box.files, _absolute(DEFAULT_WORKDIR, workdir or "."), stdin, env)
        command = world.start(self.provider._api_key, self.id, lambda c: shell.run(argv, c))
        if command.ended and not world.faults.cut_stream:
            # A built-in that ended at once (`true`, `echo`): its output is all there, no
            # stream to follow, as `follow` would give it.
            for stream, data in command.chunks:
                output.write(stream, data)
            if command.error is not None:
                raise command.error
            return ExecResult(command.exit_code)
        followed = 0
        try:
            while True:
                try:
                    async for stream, data in world.follow(command, followed):
                        output.write(stream, data)
                        followed += 1
                    return ExecResult(command.exit_code)
                except StreamCut:
                    continue  # the command runs on: follow it again from where it broke
        finally:
            stop(command)  # cancelled by the relay's deadline: the command ends too

    async def folder_entries(self, path: str) -> list[FileEntry]:
        world, key = self.provider.world, self.provider._api_key
        try:
            listed = world.folder(key, self.id, path)
        except PathMissing as exc:
            raise FileUnreadable("no such folder") from exc
        return [
            FileEntry(name, "folder" if is_folder else "file", None if is_folder else size)
            for name, is_folder, size in listed
        ]

    async def file_chunks(self, path: str, limit: int, size: int | None) -> AsyncIterator[bytes]:
        world, key, offset = self.provider.world, self.provider._api_key, 0
        while offset < limit:
            try:
                chunk = world.read(key, self.id, path, offset, min(READ_BYTES, limit - offset))
            except PathMissing as exc:
                raise FileUnreadable("no such file") from exc
            if not chunk:
                return
            offset += len(chunk)
            yield chunk
            await asyncio.sleep(0)  # a call per chunk, as over a network


READ_BYTES = 65_536
"""Bytes a memory sandbox's read asks for at a time."""


@dataclass
class Shell:
    """The built-in commands of a memory sandbox, over its files."""

    files: dict[str, bytes]
    workdir: str
    stdin: bytes | None
    env: Mapping[str, str]

    def run(self, argv: Sequence[str], command: Command) -> int | Awaitable[int]:
        """The exit code of a built-in that ends at once; a script or ``sleep`` is awaited."""
        if len(argv) == 3 and argv[0] == "sh" and argv[1] == "-c":
            return self.script(argv[2], command)
        if argv[:1] == ["sleep"]:
            return self.sleep(argv[1:])
        return self.builtin(argv, command, "stdout")

    async def script(self, text: str, command: Command) -> int:
        code = 0
        for statement in text.split(";"):
            words = shlex.split(statement)
            stream: StreamName = "stdout"
            if words[-1:] == [">&2"]:
                words, stream = words[:-1], "stderr"
            if len(words) > 2 and words[0] == "echo" and words[-2] == ">":
                self.files[_absolute(self.workdir, words[-1])] = (
                    " ".join(words[1:-2]).encode() + b"\n"
                )
                code = 0
                continue
            if words[:1] == ["exit"]:
                return int(words[1]) if len(words) > 1 else code
            if words[:1] == ["sleep"]:
                code = await self.sleep(words[1:])
            elif words:
                code = self.builtin(words, command, stream)
        return code

    async def sleep(self, args: Sequence[str]) -> int:
        await asyncio.sleep(float(args[0]))
        return 0

    def builtin(self, argv: Sequence[str], command: Command, stream: StreamName) -> int:
        name, args = argv[0], list(argv[1:])
        if name in ("true", "false"):
            return int(name == "false")
        if name == "echo":
            command.write(stream, (" ".join(args) + "\n").encode())
        elif name == "env":
            command.write(stream, "".join(f"{k}={v}\n" for k, v in self.env.items()).encode())
        elif name == "exit":
            return int(args[0]) if args else 0
        elif name == "cat":
            return self.cat(args, command, stream)
        else:
            command.write("stderr", f"memory: {name}: command not found\n".encode())
            return NOT_FOUND
        return 0

    def cat(self, paths: list[str], command: Command, stream: StreamName) -> int:
        if not paths:
            command.write(stream, self.stdin or b"")
            return 0
        for path in paths:
            data = self.files.get(_absolute(self.workdir, path))
            if data is None:
                command.write("stderr", f"cat: {path}: No such file or directory\n".encode())
                return 1
            command.write(stream, data)
        return 0


@functools.lru_cache(maxsize=256)  # a run's workdir, the same for every run of a job
def _absolute(base: str, path: str) -> str:
    return posixpath.normpath(posixpath.join(base, path))
