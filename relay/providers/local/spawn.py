"""Start a sandbox's process from asyncio without forking the whole relay.

``asyncio.create_subprocess_exec`` forks the relay under uvloop (libuv always forks), and
under CPython's own loop whenever a ``preexec_fn`` is given. Forking a relay of ~100 MB
costs it 5-10 ms of CPU and wall time on every run. :func:`spawn` starts the child with
:class:`subprocess.Popen`, which uses ``vfork`` when there is no ``preexec_fn``, hands its
pipes to the running loop, and learns of its exit through a pidfd. With a ``preexec_fn``,
or where pidfds are missing, it falls back to ``create_subprocess_exec``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any, Protocol

_READ_LIMIT = 1 << 16
_REAP_TIMEOUT_S = 5.0  # a SIGKILLed child is gone in milliseconds; bounded all the same


class Child(Protocol):
    """What the local provider needs of a started process (``asyncio.subprocess.Process``
    has it too)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    stdin: asyncio.StreamWriter | None
    stdout: asyncio.StreamReader | None
    stderr: asyncio.StreamReader | None

    async def wait(self) -> int: ...


def _pidfds_work() -> bool:
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
    return True


PIDFDS = _pidfds_work()


class _LibuvOwned:
    """A dup of a pipe's fd, handed to uvloop: libuv closes the fd itself when the transport
    closes, and uvloop then calls ``close()`` on the object it was handed, which therefore
    does nothing. Handed the pipe's own file object, uvloop closed every pipe twice (the
    second an EBADF, or, had a thread opened a file meanwhile, that file: a database's)."""

    def __init__(self, pipe: IO[bytes]) -> None:
        self.fd = os.dup(pipe.fileno())
        pipe.close()  # the original, closed once, here

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        """libuv has closed the fd already."""


def _closes_fds_itself(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether the loop's transports close their fd themselves (uvloop's libuv), rather
    than through the file object they were handed (asyncio's own loops)."""
    return type(loop).__module__.partition(".")[0] == "uvloop"


class PopenChild:
    """A :class:`subprocess.Popen` child whose pipes and exit the event loop watches."""

    def __init__(self, popen: subprocess.Popen[bytes], loop: asyncio.AbstractEventLoop) -> None:
        self.popen = popen
        self.stdin: asyncio.StreamWriter | None = None
        self.stdout: asyncio.StreamReader | None = None
        self.stderr: asyncio.StreamReader | None = None
        self._loop = loop
        self._transports: list[asyncio.BaseTransport] = []
        self._handed: set[int] = set()  # pipes (by id) a transport owns and will close
        self._exited: asyncio.Future[int] = loop.create_future()
        self._pidfd = os.pidfd_open(popen.pid)
        loop.add_reader(self._pidfd, self._reap)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    async def connect(self) -> None:
        self.stdout = await self._reader(self.popen.stdout)
        self.stderr = await self._reader(self.popen.stderr)
        if self.popen.stdin is not None:
            loop = self._loop
            writer, protocol = await loop.connect_write_pipe(
                lambda: asyncio.streams.FlowControlMixin(loop=loop),
                self._handed_over(self.popen.stdin),
            )
            self._transports.append(writer)
            self._handed.add(id(self.popen.stdin))
            self.stdin = asyncio.StreamWriter(writer, protocol, None, loop)

    async def _reader(self, pipe: IO[bytes] | None) -> asyncio.StreamReader | None:
        if pipe is None:
            return None
        loop = self._loop
        reader = asyncio.StreamReader(limit=_READ_LIMIT, loop=loop)

        def protocol() -> asyncio.StreamReaderProtocol:
            return asyncio.StreamReaderProtocol(reader, loop=loop)

        transport, _ = await loop.connect_read_pipe(protocol, self._handed_over(pipe))
        self._transports.append(transport)
        self._handed.add(id(pipe))
        return reader

    def _handed_over(self, pipe: IO[bytes]) -> IO[bytes] | _LibuvOwned:
        """What to give the loop for ``pipe``: the pipe, or for uvloop a dup it owns."""
        return _LibuvOwned(pipe) if _closes_fds_itself(self._loop) else pipe

    def _reap(self) -> None:
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        try:
            _, status = os.waitpid(self.popen.pid, 0)  # it has exited: this does not block
            code = os.waitstatus_to_exitcode(status)
        except ChildProcessError:  # reaped elsewhere: the status is lost, not the exit
            code = -signal.SIGKILL
        self.popen.returncode = code
        if not self._exited.done():
            self._exited.set_result(code)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def close(self) -> None:
        """Close the pipes (the child may still hold its ends), also those that a
        cancelled :meth:`connect` never handed to the loop."""
        for transport in self._transports:
            transport.close()
        for pipe in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if pipe is not None and id(pipe) not in self._handed:
                pipe.close()


async def spawn(
    argv: Sequence[str],
    *,
    stdin: bool,
    env: Mapping[str, str],
    cwd: str | None,
    preexec_fn: Callable[[], None] | None,
    pass_fds: Sequence[int] = (),
) -> Child:
    """Start ``argv`` in a new session with piped stdout/stderr (and stdin if asked);
    ``pass_fds`` stay open in the child, under the same numbers."""
    options: dict[str, Any] = {
        "stdin": subprocess.PIPE if stdin else subprocess.DEVNULL,
        "stdout": subprocess.PIPE,
        "stderr": subprocess.PIPE,
        "env": dict(env),
        "cwd": cwd,
        "start_new_session": True,
        "pass_fds": tuple(pass_fds),
    }
    if preexec_fn is not None or not PIDFDS:
        return await asyncio.create_subprocess_exec(*argv, preexec_fn=preexec_fn, **options)
    # vfork + exec: well under a millisecond
    popen = subprocess.Popen(list(argv), **options)  # noqa: ASYNC220
    try:
        child = PopenChild(popen, asyncio.get_running_loop())
    except BaseException:
        _kill(popen.pid)
        popen.wait()  # killed: reaped at once
        raise
    try:
        # A run's deadline or a cancel can land here: uvloop closes the fd of a connect it
        # abandons, which is why it gets a dup of its own (_LibuvOwned); closing the pipe
        # then closed that number again (EBADF: a 502 for the run).
        await child.connect()
    except BaseException:
        _kill(popen.pid)
        child.close()
        # Killed, it exits at once: wait for the pidfd watch to reap it, so a caller whose
        # loop ends next (a relay shutting down, a test) leaves no child behind.
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(child.wait(), _REAP_TIMEOUT_S)
        raise
    return child


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def close(child: Child) -> None:
    """Release a finished child's pipes (a no-op for an asyncio subprocess)."""
    if isinstance(child, PopenChild):
        child.close()
