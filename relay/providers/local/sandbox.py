"""A local sandbox (:class:`LocalSandbox`): its uploads, the command it starts in
bubblewrap (or a process group), the setup steps run before the job starts, and the pumps
of its output.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from ipaddress import IPv4Network
from pathlib import Path, PurePosixPath
from typing import Protocol

from relay.cancellation import shielded
from relay.errors import FileUnreadable, ProviderError, SandboxLost
from relay.providers.contract import (
    DEFAULT_WORKDIR,
    SANDBOX_MARKER,
    ExecResult,
    FileEntry,
    OutputSink,
    SandboxSpec,
)
from relay.providers.lifecycle import ProviderSandbox, SandboxOwner
from relay.providers.local import cgroups, files, private_network
from relay.providers.local.deathwatch import Deathwatch
from relay.providers.local.invocation import (
    BASE_ENV,
    HOST_ENV,
    HOSTNAME,
    MIB,
    OWN_FILES,
    WRITABLE,
    Invocation,
    child_setup,
    host_wrapper,
    memfd,
    meminfo,
    refuse_nul,
    sandbox_path,
    system_binds,
)
from relay.providers.local.root import ENDING_FILE, TAGS_FILE, kill_group
from relay.providers.local.spawn import Child, spawn
from relay.providers.local.spawn import close as close_child
from relay.providers.local.uids import HeldUid

log = logging.getLogger("relay.providers.local")

_READ_CHUNK = 65_536
_INFO_TIMEOUT_S = 30.0

SetupStep = Callable[["LocalSandbox", int], Awaitable[None]]
"""A step run with the pid of bwrap's child, after it exists and before it runs the job."""


class ProviderView(SandboxOwner, Protocol):
    """What a sandbox reads of its provider: ``LocalProvider``, whose module imports this
    one, so the sandbox names the provider by what it uses of it."""

    @property
    def root(self) -> Path: ...
    @property
    def isolation(self) -> str: ...
    @property
    def network(self) -> private_network.NetworkTool | None: ...
    @property
    def egress_allow(self) -> Sequence[IPv4Network]: ...
    @property
    def bwrap(self) -> str: ...
    @property
    def disable_userns(self) -> bool: ...
    @property
    def prlimit(self) -> str | None: ...
    @property
    def timeout(self) -> str: ...
    @property
    def setpriv(self) -> str: ...
    @property
    def shell(self) -> str: ...
    @property
    def deathwatch(self) -> Deathwatch: ...
    @property
    def nsenter(self) -> str: ...
    @property
    def setup_steps(self) -> Sequence[SetupStep]: ...
    def sizes(self, spec: SandboxSpec) -> tuple[int, int]: ...
    def start_command(self) -> None: ...
    def end_command(self) -> None: ...
    def rlimits(self, cpu_s: int, memory_mb: int) -> dict[str, tuple[int, int]]: ...


class LocalSandbox(ProviderSandbox):
    """A host folder (tags and lock), a cgroup, and the processes started in it."""

    provider: ProviderView

    def __init__(self, provider: ProviderView, sandbox_id: str, spec: SandboxSpec) -> None:
        super().__init__(provider, sandbox_id)
        self.spec = spec
        self.home = provider.root / sandbox_id
        self.processes: list[Child] = []
        self.created = time.monotonic()
        self.files: dict[PurePosixPath, bytes] = {}
        self.group: cgroups.SandboxGroup | None = None
        self.lock: int | None = None
        self.network: private_network.Attachment | None = None
        self.uid: HeldUid | None = None
        """The host uid of a root relay's sandbox (relay/providers/local/uids.py)."""
        self.view: files.View | None = None
        """The namespaces of its last command, held so its files can be read after it
        (relay/providers/local/files.py); closed when the sandbox ends."""
        self.memory_mb, self.disk_mb = provider.sizes(spec)

    def _host_path(self, path: str, workdir: str) -> Path:
        """Without bubblewrap: where a sandbox path lives on the host."""
        inside = sandbox_path(path, workdir)
        top = PurePosixPath("/", inside.parts[1])
        outside = self.home / ("work" if top == PurePosixPath(DEFAULT_WORKDIR) else "tmp")
        resolved = (outside / inside.relative_to(top)).resolve()
        if not resolved.is_relative_to(outside.resolve()):
            raise ProviderError(f"the path leaves the sandbox: {path}")
        return resolved

    async def write_files(self, files: Mapping[str, bytes]) -> None:
        for path, content in files.items():
            if self.provider.isolation == "none":
                target = self._host_path(path, DEFAULT_WORKDIR)
                target.parent.mkdir(parents=True, exist_ok=True)
                await asyncio.to_thread(target.write_bytes, content)
            else:
                self.files[sandbox_path(path, DEFAULT_WORKDIR)] = content

    def hold_view(self, view: files.View | None) -> None:
        """Hold ``view`` (the newest command's), letting go of the one held before."""
        if self.view is not None:
            self.view.close()
        self.view = view

    def _reader(self, path: str) -> tuple[list[str], str, list[int]]:
        """How to read ``path`` of this sandbox: the command prefix, the path as that
        command sees it, the fds it needs."""
        if self.provider.isolation == "none":
            return [], str(self._host_path(path, DEFAULT_WORKDIR)), []
        if self.view is None:
            raise FileUnreadable("the sandbox has run no command")
        fds = [self.view.user, self.view.mount]
        return self.view.prefix(self.provider.nsenter), path, fds

    async def folder_entries(self, path: str) -> list[FileEntry]:
        prefix, where, fds = self._reader(path)
        return await files.listed(prefix, where, fds)

    async def file_chunks(self, path: str, limit: int, size: int | None) -> AsyncIterator[bytes]:
        prefix, where, fds = self._reader(path)
        async for chunk in files.read(prefix, where, limit, fds):
            yield chunk

    def _bwrap_args(self, workdir: str, env: Mapping[str, str]) -> tuple[list[str], list[int]]:
        """bwrap's options (read from its --args memfd) and the file memfds they name."""
        disk = str(self.disk_mb * MIB)
        args = ["--die-with-parent", "--unshare-all", "--new-session", "--hostname", HOSTNAME]
        args += ["--unshare-user", "--uid", "65534", "--gid", "65534", "--cap-drop", "ALL"]
        if self.provider.disable_userns:
            args.append("--disable-userns")
        args += system_binds()
        for mount in (*WRITABLE, "/dev/shm"):  # noqa: S108 (inside the sandbox)
            args += ["--size", disk, "--tmpfs", mount]
        fds: list[int] = []
        try:
            # The sandbox's own accounts and names, not the host's; its own memory total.
            own = {f"/etc/{name}": content for name, content in OWN_FILES.items()}
            own["/proc/meminfo"] = meminfo(self.memory_mb + self.disk_mb)
            for target, content in own.items():
                fd = memfd(target.rpartition("/")[2], content)
                fds.append(fd)
                args += ["--ro-bind-data", str(fd), target]
            for path, content in self.files.items():
                fd = memfd("upload", content)
                fds.append(fd)
                args += ["--dir", str(path.parent), "--perms", "0644", "--file", str(fd)]
                args.append(str(path))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        tool = self.provider.network
        if self.spec.egress.open and tool is not None:
            # The host's resolv.conf may name 127.0.0.53, closed to the sandbox.
            fd = memfd("resolv.conf", tool.resolv_conf().encode())
            fds.append(fd)
            args += ["--ro-bind-data", str(fd), "/etc/resolv.conf"]
        args += ["--dir", workdir, "--remount-ro", "/", "--chdir", workdir, "--clearenv"]
        for name, value in {**BASE_ENV, **env, SANDBOX_MARKER: self.id}.items():
            args += ["--setenv", name, value]
        return args, fds

    def launch(
        self,
        argv: Sequence[str],
        workdir: str,
        cpu_s: int,
        env: Mapping[str, str],
        lifetime_s: int,
    ) -> Invocation:
        """How to start ``argv`` in this sandbox (the caller spawns it and closes the fds).

        With bubblewrap, ``prlimit`` sets the rlimits and the host wrapper ties the sandbox
        to the relay (:func:`~relay.providers.local.invocation.host_wrapper`), so no Python
        runs in the child and the spawn can use vfork: a ``preexec_fn`` forces a full fork
        of the relay, 5-10 ms for a relay of ~100 MB, on every run. Without bubblewrap (or
        prlimit) the child setup does it.

        ``lifetime_s`` is the sandbox's hard deadline, kept by ``timeout -s KILL`` on the
        host side of bubblewrap (which the relay's death ends early): a job cannot see,
        stop or outlive it. Every host-side process carries the sandbox's marker in its
        environment, as the job does, so a sweep finds them all.
        """
        limits = self.provider.rlimits(cpu_s, self.memory_mb)
        if self.provider.isolation == "none":
            # The tie's signal goes to `timeout`, which then kills its process group.
            argv = ["timeout", "-s", "KILL", str(lifetime_s), *argv]
            job_env = {**BASE_ENV, **env, SANDBOX_MARKER: self.id, "HOME": str(self.home / "work")}
            cwd = str(self._host_path(".", workdir))
            setup = child_setup(limits, signal.SIGALRM)
            return Invocation(list(argv), job_env, cwd, setup)
        refuse_nul(list(argv), "command")
        refuse_nul([*env, *env.values()], "environment")
        options, fds = self._bwrap_args(workdir, env)
        invocation = Invocation([], {**HOST_ENV, SANDBOX_MARKER: self.id}, fds=fds)
        try:
            args_fd = memfd("bwrap-args", b"".join(o.encode() + b"\0" for o in options))
            invocation.fds.append(args_fd)
            invocation.info = os.pipe2(os.O_CLOEXEC)
            invocation.block = os.pipe2(os.O_CLOEXEC)
        except BaseException:
            invocation.close()
            raise
        command = host_wrapper(
            self.provider.setpriv,
            self.uid.uid if self.uid else None,
            self.provider.shell,
            self.provider.timeout,
            lifetime_s,
        )
        command += [self.provider.bwrap, "--args", str(args_fd)]
        command += ["--info-fd", str(invocation.info[1]), "--block-fd", str(invocation.block[0])]
        # The release waits for the relay's byte, never for the pipe's end: the chain in
        # front of bubblewrap holds the write end too, so a relay killed during the setup
        # steps leaves the sandbox blocked, in `timeout`'s process group, which its death
        # kills. (The end of file of a plain block pipe released the sandbox at once, and it
        # left that group before `timeout` could act.)
        command += ["--sync-fd", str(invocation.block[1])]
        command += ["--", *argv]
        if self.provider.prlimit is None:
            invocation.argv, invocation.setup = command, child_setup(limits)
            return invocation
        flags = [f"--{name}={soft}:{hard}" for name, (soft, hard) in limits.items()]
        invocation.argv = [self.provider.prlimit, *flags, "--", *command]
        return invocation

    async def _release(self, process: Child, invocation: Invocation) -> None:
        """Read bwrap's child pid, run the setup steps with it, then let the job start.

        If bwrap ends before it reports (bad options), its exit and stderr tell the run.
        """
        assert invocation.info is not None and invocation.block is not None
        invocation.close_child_ends()
        info = await _read_info(invocation.info[0])
        if info is None:
            return
        try:
            pid = int(str(info["child-pid"]))
            self.hold_view(files.View(pid))
            for step in self.provider.setup_steps:
                await step(self, pid)
        except private_network.NetworkError as exc:
            kill_group(process.pid)  # before the block fd closes: EOF would start the job
            log.warning("sandbox %s: private network failed: %s", self.id, exc)
            raise ProviderError("could not attach the sandbox's private network") from exc
        except ProcessLookupError:
            # bwrap's child ended during its own setup (a file it could not create):
            # nothing can run, and bwrap's exit and stderr tell the run why.
            kill_group(process.pid)
            return
        except (OSError, ValueError, KeyError) as exc:
            kill_group(process.pid)
            log.warning(
                "sandbox %s: a setup step failed",
                self.id,
                extra={"error_class": type(exc).__name__, "error": str(exc)[:200]},
            )
            raise ProviderError("could not set up the sandbox's limits") from exc
        os.write(invocation.block[1], b"1")

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
        workdir = str(sandbox_path(workdir or ".", DEFAULT_WORKDIR))
        if self.provider.isolation == "none":
            self._host_path(".", workdir).mkdir(parents=True, exist_ok=True)
        # The sandbox's own hard deadline: even a relay that hangs cannot keep it alive.
        left = max(1, int(self.created + self.spec.lifetime_s - time.monotonic()))
        cpu_s = max(1, int(self.spec.lifetime_s))
        self.provider.start_command()
        try:
            code = await self._start(argv, workdir, cpu_s, env, left, stdin, output)
        finally:
            self.provider.end_command()
        if not (self.home / TAGS_FILE).exists() or (self.home / ENDING_FILE).exists():
            raise SandboxLost("the sandbox was terminated during the run")
        killed = self.group.oom_kills() if self.group is not None else 0
        memory_limit = self.memory_mb + self.disk_mb if killed else None
        return ExecResult(exit_code=code if code >= 0 else 128 - code, memory_limit_mb=memory_limit)

    async def _start(
        self,
        argv: Sequence[str],
        workdir: str,
        cpu_s: int,
        env: Mapping[str, str],
        lifetime_s: int,
        stdin: bytes | None,
        output: OutputSink,
    ) -> int:
        """Spawn the command and run it to its end (its exit code)."""
        invocation = self.launch(argv, workdir, cpu_s, env, lifetime_s=lifetime_s)
        # Before the spawn: whenever a relay is killed from here on, the deathwatch ends
        # what the command left (relay/providers/local/deathwatch.py).
        watched = self.provider.deathwatch.watch(self.id) if invocation.info else None
        try:
            try:
                process = await spawn(
                    invocation.argv,
                    stdin=stdin is not None,
                    env=invocation.env,
                    cwd=invocation.cwd,
                    preexec_fn=invocation.setup,
                    pass_fds=invocation.child_fds(),
                )
            except OSError as exc:
                raise ProviderError(f"could not start the command: {exc.strerror}") from exc
            self.processes.append(process)
            return await self._run(process, invocation, stdin, output)
        finally:
            invocation.close()
            if watched is not None:  # ended, or killed and left to its ties
                self.provider.deathwatch.forget(watched)

    async def _run(
        self, process: Child, invocation: Invocation, stdin: bytes | None, output: OutputSink
    ) -> int:
        pumps = [
            asyncio.create_task(_pump(process.stdout, "stdout", output)),
            asyncio.create_task(_pump(process.stderr, "stderr", output)),
        ]
        try:
            if invocation.info is not None:
                async with asyncio.timeout(_INFO_TIMEOUT_S):
                    await self._release(process, invocation)
            if stdin is not None and process.stdin is not None:
                pumps.append(asyncio.create_task(_feed(process.stdin, stdin)))
            code = await process.wait()
            # A background child may hold the pipes open after the command ended (only
            # without bubblewrap, whose PID namespace ends with the command): don't wait.
            await asyncio.wait(pumps, timeout=1.0)
        finally:
            if process.returncode is None:
                kill_group(process.pid)
            for pump in pumps:
                pump.cancel()
            # Shielded: the run's exec deadline cancels again every loop turn until the
            # exec ends, which would stop this cleanup at its first await.
            await shielded(self._close_command(process, pumps))
        return code

    async def _close_command(self, process: Child, pumps: list[asyncio.Task[None]]) -> None:
        """Wait for the cancelled pumps, release the pipes, detach the private network."""
        await asyncio.gather(*pumps, return_exceptions=True)
        close_child(process)
        if self.network is not None:
            network, self.network = self.network, None
            await network.close()


def _set_once(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _read_info(fd: int) -> dict[str, object] | None:
    """bwrap's ``--info-fd`` JSON, or ``None`` when it closed the pipe without one."""
    loop = asyncio.get_running_loop()
    os.set_blocking(fd, False)
    data = bytearray()
    while True:
        readable: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, _set_once, readable)
        try:
            await readable
        finally:
            loop.remove_reader(fd)
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            continue
        if not chunk:
            return None
        data += chunk
        with contextlib.suppress(ValueError):
            info = json.loads(data)
            if isinstance(info, dict):
                return info


async def _pump(stream: asyncio.StreamReader | None, name: str, output: OutputSink) -> None:
    if stream is None:
        return
    while chunk := await stream.read(_READ_CHUNK):
        output.write("stdout" if name == "stdout" else "stderr", chunk)


async def _feed(pipe: asyncio.StreamWriter, data: bytes) -> None:
    with contextlib.suppress(ConnectionError):
        pipe.write(data)
        await pipe.drain()
        pipe.close()
