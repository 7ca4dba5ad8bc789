"""The embedded ``local`` provider: a sandbox on the relay's own machine.

With bubblewrap (``RELAY_LOCAL_ISOLATION=bwrap``, or ``auto`` when ``bwrap`` works):
a read-only view of the system (``/usr`` and a few harmless ``/etc`` files, never the
relay's own folder, token file or ``.env``), new PID, user, IPC, UTS and network
namespaces (the network is shared only for ``egress = ["*"]``), no capabilities, and
``--die-with-parent``: if the relay dies, its sandboxes die with it, and when the command
ends everything it spawned ends too.

Nothing of a request reaches the host:

* every process the relay starts on the host (``prlimit``, ``bwrap``) gets a fixed
  environment of the relay's making (:data:`HOST_ENV`); the job's variables enter the
  sandbox only, through ``--clearenv`` and ``--setenv``;
* bwrap reads its options from a memfd (``--args FD``), so the sandbox's
  ``/proc/1/cmdline`` shows ``bwrap --args N …`` and never a host path;
* no host folder is bound into the sandbox: ``/workspace``, ``/tmp`` and ``/dev/shm`` are
  tmpfs mounts capped at the run's disk size (writes past it fail with ``ENOSPC``), ``/``
  is read-only, and uploaded files (kept in memory by :meth:`LocalSandbox.upload`) are
  copied in from memfds when the command starts. So **each exec starts from the uploaded
  files** (the relay runs one command per sandbox), and nothing a job writes lands on the
  host's disk. A sandbox's host folder holds only its ``tags.json`` (for the reaper) and a
  ``lock`` the relay keeps ``flock``-ed while the sandbox lives.

Each sandbox gets a cgroup (:mod:`relay.providers.cgroups`) with a memory limit (the
size's memory plus its disk, since the disk is RAM; no swap), a process limit and a CPU
quota. bwrap's child waits (``--block-fd``) until the relay has read its pid
(``--info-fd``), moved it into the group and run every other setup step
(:attr:`LocalProvider.setup_steps`); only then does the job start. When the kernel
killed a process of the job for memory, the run ends ``failed`` with ``out_of_memory``.
Where cgroups cannot be used, the relay says so once at startup and falls back to
``RLIMIT_NPROC``, ``RLIMIT_AS`` and the size-capped tmpfs mounts.

Without bubblewrap (``none``): a process group with rlimits, marked with ``SANDBOX_ID`` so a
``setsid`` child is still found and killed, in host folders under the sandbox root. That
mode is **no security boundary** and cannot keep a job off the network; ``auto`` refuses
to run a no-network job in it, while an explicit ``none`` is the operator's choice.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import json
import logging
import os
import resource
import secrets
import shutil
import signal
import stat
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import ClassVar

from relay.errors import ConfigError, EgressUnsupported, ProviderError, SandboxLost
from relay.providers.base import (
    DEFAULT_WORKDIR,
    SANDBOX_MARKER,
    TAG_CLUSTER,
    TAG_RUN,
    ExecResult,
    OutputSink,
    Rate,
    SandboxRef,
    SandboxSpec,
    shielded,
)
from relay.providers.local import cgroups, private_network
from relay.providers.local.spawn import Child, spawn
from relay.providers.local.spawn import close as close_child
from relay.settings import Settings

log = logging.getLogger("relay.providers.local")

_ETC_FILES = (
    "alternatives",
    "ssl",
    "ca-certificates",
    "ca-certificates.conf",
    "resolv.conf",
    "hosts",
    "nsswitch.conf",
    "localtime",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "python3",
    "python3.11",
    "mime.types",
    "gai.conf",
    "host.conf",
    "protocols",
    "services",
    "os-release",
    "debian_version",
)
_BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": DEFAULT_WORKDIR, "LANG": "C.UTF-8"}
HOST_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
"""The whole environment of every host-side process the relay starts with bubblewrap."""
_MARKER = SANDBOX_MARKER
_ACCOUNTS = {
    "passwd": b"root:x:0:0:root:/root:/usr/sbin/nologin\n"
    b"nobody:x:65534:65534:nobody:/workspace:/usr/sbin/nologin\n",
    "group": b"root:x:0:\nnogroup:x:65534:\n",
}
"""``/etc/passwd`` and ``/etc/group`` inside a sandbox: the host's would name its users."""
OOM_SCORE_ADJ = "1000"
"""A sandbox's processes are the first the kernel kills when the host (or the relay's
unit) runs out of memory, never the relay."""
_READ_CHUNK = 65_536
_PR_SET_PDEATHSIG = 1
_MIB = 1024 * 1024
_WRITABLE = ("/workspace", "/tmp")  # noqa: S108
_INFO_TIMEOUT_S = 30.0
_LOCK = "lock"
_TAGS = "tags.json"


def _system_binds() -> list[str]:
    """Read-only system folders and harmless /etc files; nothing of the relay's own."""
    binds = ["--ro-bind", "/usr", "/usr"]
    for link in ("bin", "lib", "lib32", "lib64", "sbin"):
        host = Path("/", link)
        if host.is_symlink():
            binds += ["--symlink", os.readlink(host), f"/{link}"]
        elif host.is_dir():
            binds += ["--ro-bind", str(host), f"/{link}"]
    for name in _ETC_FILES:
        if Path("/etc", name).exists():
            binds += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
    return [*binds, "--proc", "/proc", "--dev", "/dev"]


def bwrap_works() -> bool:
    """True when bubblewrap is installed and can create its namespaces here."""
    return bwrap_problem() is None


BWRAP_FIXES = (
    # (words in bwrap's error, what the host must allow), the first match wins. In a
    # container these are the `docker run` flags docs/deploy.md explains.
    (
        ("can't mount proc",),
        "a container masks /proc: run it with --security-opt systempaths=unconfined",
    ),
    (
        ("no permissions to create", "creating new namespace", "setting up uid map"),
        "user namespaces are refused: in a container run it with --security-opt "
        "seccomp=unconfined (or a seccomp profile that allows them), on a host allow them "
        "(sysctl user.max_user_namespaces, kernel.apparmor_restrict_unprivileged_userns=0)",
    ),
    (
        ("permission denied", "operation not permitted"),
        "a security profile refuses its mounts: in a container run it with --security-opt "
        "apparmor=unconfined (and seccomp=unconfined, systempaths=unconfined)",
    ),
)


def bwrap_fix(error: str) -> str:
    """What the host must allow for bubblewrap, from the error it printed."""
    lowered = error.lower()
    for words, fix in BWRAP_FIXES:
        if any(word in lowered for word in words):
            return fix
    return "see docs/deploy.md (bubblewrap in a container), or set RELAY_LOCAL_ISOLATION=none"


def bwrap_problem() -> str | None:
    """Why bubblewrap cannot sandbox a job here, in one line naming the fix, or ``None``."""
    path = shutil.which("bwrap")
    if path is None:
        return "bubblewrap is not installed: apt-get install bubblewrap"
    probe = [path, "--unshare-all", *_system_binds(), "--", "/usr/bin/true"]
    try:
        done = subprocess.run(probe, capture_output=True, timeout=10, check=False, env=HOST_ENV)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"bubblewrap did not run ({exc})"
    if done.returncode == 0:
        return None
    lines = done.stderr.decode(errors="replace").strip().splitlines()
    error = lines[-1] if lines else f"exit {done.returncode}"
    return f"bubblewrap fails here ({error}); {bwrap_fix(error)}"


def sandbox_root(settings: Settings) -> Path:
    """``RELAY_LOCAL_ROOT``, else ``sandboxes`` in the relay's state directory."""
    if settings.local_root is not None:
        return settings.local_root
    return settings.state_directory() / "sandboxes"


def check_root(root: Path) -> None:
    """Create the sandbox root 0700, or refuse one the relay cannot trust as found."""
    try:
        found = root.lstat()
    except FileNotFoundError:
        root.mkdir(parents=True, mode=0o700)
        return
    if not stat.S_ISDIR(found.st_mode):
        raise ConfigError(f"{root}: the local sandbox root is not a folder")
    if found.st_uid != os.geteuid():
        raise ConfigError(
            f"{root}: the local sandbox root belongs to uid {found.st_uid}, not to the "
            f"relay's user (uid {os.geteuid()}); remove it or set RELAY_LOCAL_ROOT"
        )
    if found.st_mode & 0o077:
        raise ConfigError(
            f"{root}: the local sandbox root has mode {stat.S_IMODE(found.st_mode):04o}; "
            "it must allow no group or other access (chmod 700 it, or remove it)"
        )


def _limits(cpu_s: int, memory_mb: int) -> dict[str, tuple[int, int]]:
    """The rlimits of a sandbox's processes, by ``prlimit`` option name."""
    address_space = max(memory_mb, 256) * _MIB * 2
    return {
        "cpu": (cpu_s, cpu_s + 1),
        "fsize": (1 << 30, 1 << 30),
        "as": (address_space, address_space),
    }


_RLIMITS = {
    "cpu": resource.RLIMIT_CPU,
    "fsize": resource.RLIMIT_FSIZE,
    "as": resource.RLIMIT_AS,
    "nproc": resource.RLIMIT_NPROC,
}


def _child_setup(limits: Mapping[str, tuple[int, int]]) -> Callable[[], None]:
    """Runs in the child before exec: die with the relay, and apply the rlimits."""

    def setup() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        for name, limit in limits.items():
            resource.setrlimit(_RLIMITS[name], limit)

    return setup


def _sandbox_path(path: str, workdir: str) -> PurePosixPath:
    """An upload or workdir path inside the sandbox, which must be under a writable mount."""
    if "\0" in path:
        raise ProviderError("a path contains a NUL byte")
    normal = PurePosixPath(os.path.normpath(PurePosixPath(workdir, path)))
    for inside in _WRITABLE:
        if normal == PurePosixPath(inside) or normal.is_relative_to(inside):
            return normal
    raise ProviderError(f"the local provider can write only under /workspace or /tmp: {path}")


@dataclass
class Invocation:
    """How to start one command: the host argv and environment, and the memfds that
    carry bwrap's options (``args``) and the uploaded files to it."""

    argv: list[str]
    env: dict[str, str]
    cwd: str | None = None
    setup: Callable[[], None] | None = None
    fds: list[int] = field(default_factory=list)  # passed to the child, closed after spawn
    info: tuple[int, int] | None = None  # (read, write) of bwrap's --info-fd pipe
    block: tuple[int, int] | None = None  # (read, write) of bwrap's --block-fd pipe
    closed: set[int] = field(default_factory=set)
    """fds already closed: a number closed twice may by then be another object's."""

    def child_fds(self) -> list[int]:
        ends = [self.info[1]] if self.info else []
        ends += [self.block[0]] if self.block else []
        return [fd for fd in (*self.fds, *ends) if fd not in self.closed]

    def _close(self, fd: int) -> None:
        if fd not in self.closed:
            self.closed.add(fd)
            with contextlib.suppress(OSError):
                os.close(fd)

    def close_child_ends(self) -> None:
        for fd in self.child_fds():
            self._close(fd)

    def close(self) -> None:
        self.close_child_ends()
        for pipe in (self.info, self.block):
            for fd in pipe or ():
                self._close(fd)


def _memfd(name: str, content: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        view = memoryview(content)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _no_nul(values: Sequence[str], what: str) -> None:
    if any("\0" in value for value in values):
        raise ProviderError(f"the {what} contains a NUL byte")


SetupStep = Callable[["LocalSandbox", int], Awaitable[None]]
"""A step run with the pid of bwrap's child, after it exists and before it runs the job."""


class LocalSandbox:
    """A host folder (tags and lock), a cgroup, and the processes started in it."""

    def __init__(self, provider: LocalProvider, sandbox_id: str, spec: SandboxSpec) -> None:
        self.id = sandbox_id
        self.provider = provider
        self.spec = spec
        self.home = provider.root / sandbox_id
        self.processes: list[Child] = []
        self.created = time.monotonic()
        self.files: dict[PurePosixPath, bytes] = {}
        self.group: cgroups.SandboxGroup | None = None
        self.lock: int | None = None
        self.network: private_network.Attachment | None = None
        self.memory_mb, self.disk_mb = provider.sizes(spec)

    def _host_path(self, path: str, workdir: str) -> Path:
        """Without bubblewrap: where a sandbox path lives on the host."""
        inside = _sandbox_path(path, workdir)
        top = PurePosixPath("/", inside.parts[1])
        outside = self.home / ("work" if top == PurePosixPath(DEFAULT_WORKDIR) else "tmp")
        resolved = (outside / inside.relative_to(top)).resolve()
        if not resolved.is_relative_to(outside.resolve()):
            raise ProviderError(f"the path leaves the sandbox: {path}")
        return resolved

    async def upload(self, files: Mapping[str, bytes]) -> None:
        for path, content in files.items():
            if self.provider.isolation == "none":
                target = self._host_path(path, DEFAULT_WORKDIR)
                target.parent.mkdir(parents=True, exist_ok=True)
                await asyncio.to_thread(target.write_bytes, content)
            else:
                self.files[_sandbox_path(path, DEFAULT_WORKDIR)] = content

    def _bwrap_args(self, workdir: str, env: Mapping[str, str]) -> tuple[list[str], list[int]]:
        """bwrap's options (read from its --args memfd) and the file memfds they name."""
        disk = str(self.disk_mb * _MIB)
        args = ["--die-with-parent", "--unshare-all", "--new-session"]
        args += ["--unshare-user", "--uid", "65534", "--gid", "65534", "--cap-drop", "ALL"]
        args += _system_binds()
        for mount in (*_WRITABLE, "/dev/shm"):  # noqa: S108 (inside the sandbox)
            args += ["--size", disk, "--tmpfs", mount]
        fds: list[int] = []
        try:
            # The sandbox's own accounts, not the host's (names and home folders).
            for name, content in _ACCOUNTS.items():
                fd = _memfd(name, content)
                fds.append(fd)
                args += ["--ro-bind-data", str(fd), f"/etc/{name}"]
            for path, content in self.files.items():
                fd = _memfd("upload", content)
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
            fd = _memfd("resolv.conf", tool.resolv_conf().encode())
            fds.append(fd)
            args += ["--ro-bind-data", str(fd), "/etc/resolv.conf"]
        args += ["--dir", workdir, "--remount-ro", "/", "--chdir", workdir, "--clearenv"]
        for name, value in {**_BASE_ENV, **env, _MARKER: self.id}.items():
            args += ["--setenv", name, value]
        return args, fds

    def launch(
        self,
        argv: Sequence[str],
        workdir: str,
        cpu_s: int,
        env: Mapping[str, str],
        lifetime_s: int | None = None,
    ) -> Invocation:
        """How to start ``argv`` in this sandbox (the caller spawns it and closes the fds).

        With bubblewrap, ``prlimit`` sets the rlimits and bwrap's ``--die-with-parent``
        ties the sandbox to the relay, so no Python runs in the child and the spawn can
        use vfork: a ``preexec_fn`` forces a full fork of the relay, 5-10 ms for a relay
        of ~100 MB, on every run. Without bubblewrap (or prlimit) the child setup does it.

        ``lifetime_s`` is the sandbox's hard deadline, kept by ``timeout -s KILL`` on the
        host side of bubblewrap (under ``setpriv --pdeathsig KILL``, so it also dies with
        the relay): a job cannot see, stop or outlive it.
        """
        limits = self.provider.rlimits(cpu_s, self.memory_mb)
        if lifetime_s is not None and self.provider.isolation == "none":
            argv = ["timeout", "-s", "KILL", str(lifetime_s), *argv]
        if self.provider.isolation == "none":
            job_env = {**_BASE_ENV, **env, _MARKER: self.id, "HOME": str(self.home / "work")}
            cwd = str(self._host_path(".", workdir))
            return Invocation(list(argv), job_env, cwd, _child_setup(limits))
        _no_nul(list(argv), "command")
        _no_nul([*env, *env.values()], "environment")
        options, fds = self._bwrap_args(workdir, env)
        invocation = Invocation([], dict(HOST_ENV), fds=fds)
        try:
            args_fd = _memfd("bwrap-args", b"".join(o.encode() + b"\0" for o in options))
            invocation.fds.append(args_fd)
            invocation.info = os.pipe2(os.O_CLOEXEC)
            invocation.block = os.pipe2(os.O_CLOEXEC)
        except BaseException:
            invocation.close()
            raise
        command = list(self.provider.host_wrapper)
        if lifetime_s is not None:
            command += [self.provider.timeout, "-s", "KILL", str(lifetime_s)]
        command += [self.provider.bwrap, "--args", str(args_fd)]
        command += ["--info-fd", str(invocation.info[1]), "--block-fd", str(invocation.block[0])]
        command += ["--", *argv]
        if self.provider.prlimit is None:
            invocation.argv, invocation.setup = command, _child_setup(limits)
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
            for step in self.provider.setup_steps:
                await step(self, pid)
        except private_network.NetworkError as exc:
            _kill_group(process.pid)  # before the block fd closes: EOF would start the job
            log.warning("sandbox %s: private network failed: %s", self.id, exc)
            raise ProviderError("could not attach the sandbox's private network") from exc
        except ProcessLookupError:
            # bwrap's child ended during its own setup (a file it could not create):
            # nothing can run, and bwrap's exit and stderr tell the run why.
            _kill_group(process.pid)
            return
        except (OSError, ValueError, KeyError) as exc:
            _kill_group(process.pid)
            log.warning(
                "sandbox %s: a setup step failed",
                self.id,
                extra={"error_class": type(exc).__name__, "error": str(exc)[:200]},
            )
            raise ProviderError("could not set up the sandbox's limits") from exc
        os.write(invocation.block[1], b"1")

    async def exec(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None,
        env: Mapping[str, str],
        workdir: str | None,
        timeout_s: float,
        output: OutputSink,
    ) -> ExecResult:
        workdir = str(_sandbox_path(workdir or ".", DEFAULT_WORKDIR))
        if self.provider.isolation == "none":
            self._host_path(".", workdir).mkdir(parents=True, exist_ok=True)
        # The sandbox's own hard deadline: even a relay that hangs cannot keep it alive.
        left = max(1, int(self.created + self.spec.lifetime_s - time.monotonic()))
        cpu_s = max(1, int(self.spec.lifetime_s))
        invocation = self.launch(argv, workdir, cpu_s, env, lifetime_s=left)
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
            code = await self._run(process, invocation, stdin, output)
        finally:
            invocation.close()
        if not self.home.exists():
            raise SandboxLost("the sandbox was terminated during the run")
        killed = self.group.oom_kills() if self.group is not None else 0
        memory_limit = self.memory_mb + self.disk_mb if killed else None
        return ExecResult(exit_code=code if code >= 0 else 128 - code, memory_limit_mb=memory_limit)

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
                _kill_group(process.pid)
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            close_child(process)
            if self.network is not None:
                network, self.network = self.network, None
                await network.close()
        return code


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


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _marked_pids(sandbox_id: str) -> list[int]:
    """Processes whose environment carries this sandbox's marker (setsid escapees)."""
    marker = f"{_MARKER}={sandbox_id}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
    return found


def _host_wrapper() -> list[str]:
    """``setpriv`` before bubblewrap: ``--pdeathsig KILL`` ends the sandbox's host-side
    processes with the relay, and a relay running as root drops to nobody (65534), for
    bubblewrap maps the sandbox's user to the user that starts it: an escape would
    otherwise be the host's root."""
    setpriv = shutil.which("setpriv", path=HOST_ENV["PATH"])
    if setpriv is None:
        raise ConfigError(
            "the local provider needs setpriv (util-linux) to start bubblewrap; install it, "
            "or set RELAY_LOCAL_ISOLATION=none to run without isolation"
        )
    wrapper = [setpriv, "--pdeathsig=KILL"]
    if os.geteuid() == 0:
        wrapper += ["--reuid=65534", "--regid=65534", "--clear-groups"]
        wrapper += ["--inh-caps=-all", "--bounding-set=-all"]
    return [*wrapper, "--"]


def _lock_held(home: Path) -> bool:
    """True while some relay (this one included) keeps the sandbox's lock."""
    try:
        fd = os.open(home / _LOCK, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _remove_home(home: Path) -> None:
    """Remove a sandbox's folder, its ``tags.json`` last, so a folder that could not be
    removed stays listed for the reaper. Unreadable folders (``chmod 000``) are opened up."""

    def opened_up(function: Callable[..., object], path: str, _exc: object) -> None:
        os.chmod(os.path.dirname(path) or ".", 0o700)
        with contextlib.suppress(OSError):
            os.chmod(path, 0o700)
        function(path)

    for entry in list(home.iterdir()):
        if entry.name == _TAGS:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, onerror=opened_up)
        else:
            entry.unlink()
    (home / _TAGS).unlink(missing_ok=True)
    home.rmdir()


class LocalProvider:
    """Sandboxes as bubblewrap jails (or plain process groups) on this machine."""

    name: ClassVar[str] = "local"
    rate: ClassVar[Rate] = Rate(0.0, 0.0)  # the operator's own machine

    def __init__(self, settings: Settings) -> None:
        self.cluster = settings.cluster
        self.settings = settings
        self.explicit_none = settings.local_isolation == "none"
        if settings.local_isolation == "auto":
            self.isolation = "bwrap" if bwrap_works() else "none"
        else:
            self.isolation = settings.local_isolation
        if settings.local_isolation == "bwrap":
            # Asked for by name (deploy/container.env does): refuse to start rather than
            # answer every run with an error that hides what the host must allow.
            problem = bwrap_problem()
            if problem is not None:
                raise ConfigError(f"RELAY_LOCAL_ISOLATION=bwrap: {problem}")
        self.bwrap = shutil.which("bwrap", path=HOST_ENV["PATH"]) or "bwrap"
        self.network = private_network.available(settings.local_network)
        self.egress_allow = list(settings.local_egress_allow)
        self.prlimit = shutil.which("prlimit", path=HOST_ENV["PATH"])
        self.host_wrapper = _host_wrapper() if self.isolation == "bwrap" else []
        self.timeout = shutil.which("timeout", path=HOST_ENV["PATH"]) or "timeout"
        self.root = sandbox_root(settings)
        check_root(self.root)
        self._live: dict[str, LocalSandbox] = {}
        self.cleanup_failures = 0
        """Terminates whose cleanup failed (``relay_local_cleanup_failures_total``)."""
        self.tree: cgroups.CgroupTree | None = None
        self.setup_steps: list[SetupStep] = []
        """Run in order with bwrap's child pid, before the job starts (cgroup, network)."""
        if self.isolation == "bwrap":
            self.setup_steps.append(_first_to_go)
        if self.isolation == "none":
            log.warning(
                "local provider without bubblewrap: no security boundary, no egress control"
            )
            return
        if settings.local_cgroups:
            self.tree, reason = cgroups.detect(self.root)
        else:
            reason = "RELAY_LOCAL_CGROUPS=false"
        if self.tree is None:
            log.warning(
                "local provider: cgroups unavailable (%s); each sandbox is limited by "
                "RLIMIT_NPROC, RLIMIT_AS and size-capped tmpfs mounts only, with no "
                "memory, process or CPU limit of its own",
                reason,
            )
        else:
            self.setup_steps.append(_join_group)
            self._sweep_leftovers()
        self.setup_steps.append(_attach_network)

    @property
    def limits(self) -> dict[str, str | bool]:
        """Which limits are in force (``GET /v1/providers``, ``relay probe local``)."""
        grouped = self.tree is not None
        return {
            "isolation": self.isolation,
            "cgroup": self.tree.version if self.tree is not None else "none",
            "memory": grouped,
            "pids": grouped,
            "cpu": grouped,
            "disk": self.isolation == "bwrap",
        }

    def sizes(self, spec: SandboxSpec) -> tuple[int, int]:
        """The memory and disk (MiB) of a sandbox: its size's, within the operator's caps."""
        memory_mb, disk_mb = spec.resources.memory_mb, spec.resources.disk_mb
        if self.settings.local_max_memory_mb is not None:
            memory_mb = min(memory_mb, self.settings.local_max_memory_mb)
        if self.settings.local_max_disk_mb is not None:
            disk_mb = min(disk_mb, self.settings.local_max_disk_mb)
        return memory_mb, disk_mb

    def rlimits(self, cpu_s: int, memory_mb: int) -> dict[str, tuple[int, int]]:
        limits = _limits(cpu_s, memory_mb)
        if self.tree is None and self.isolation == "bwrap":
            pids = self.settings.local_pids_max
            limits["nproc"] = (pids, pids)
        return limits

    def problem(self) -> str | None:
        """Why the sandbox root is unusable now (``/readyz``), or ``None``."""
        try:
            found = self.root.stat()
        except OSError:
            return "the sandbox root is gone"
        if not stat.S_ISDIR(found.st_mode) or not os.access(self.root, os.W_OK | os.X_OK):
            return "the sandbox root is not writable"
        if found.st_uid != os.geteuid() or found.st_mode & 0o077:
            return "the sandbox root has another owner or group/other permissions"
        return None

    def _sweep_leftovers(self) -> None:
        """Kill what an earlier relay on this root left in its sandbox groups (a sandbox
        whose lock nobody holds, or whose folder is gone)."""
        assert self.tree is not None
        swept = 0
        for sandbox_id in self.tree.names():
            if _lock_held(self.root / sandbox_id):
                continue
            try:
                self.tree.group(sandbox_id).remove()
                swept += 1
            except OSError as exc:
                log.error(
                    "could not remove a leftover sandbox group",
                    extra={"sandbox_id": sandbox_id, "error_class": type(exc).__name__},
                )
        if swept:
            log.warning("local provider: killed %d leftover sandbox group(s)", swept)

    def check(self, spec: SandboxSpec) -> None:
        if spec.egress.open:
            if self.isolation == "bwrap" and self.network is None:
                raise EgressUnsupported(
                    'egress ["*"] on the local provider needs user-mode networking: install '
                    "passt (pasta) or slirp4netns, or set RELAY_LOCAL_NETWORK=auto"
                )
            if self.isolation == "none" and not self.explicit_none:
                raise EgressUnsupported(
                    'egress ["*"] on the local provider needs bubblewrap and passt (pasta) '
                    "or slirp4netns; without them it would be the host's own network"
                )
            return
        if not spec.egress.none:
            raise EgressUnsupported(
                'the local provider cannot enforce a host allow-list; use [] or ["*"]'
            )
        if self.isolation == "none" and not self.explicit_none:
            raise EgressUnsupported(
                "the local provider cannot block the network without bubblewrap; install "
                "bubblewrap, or set RELAY_LOCAL_ISOLATION=none to run without isolation"
            )

    @asynccontextmanager
    async def sandbox(self, spec: SandboxSpec) -> AsyncIterator[LocalSandbox]:
        sandbox_id = f"lcl-{spec.run_id.removeprefix('run_')}-{secrets.token_hex(3)}"
        box = LocalSandbox(self, sandbox_id, spec)
        self._live[sandbox_id] = box
        try:
            self._create(box)
            yield box
        except BaseException:
            with contextlib.suppress(ProviderError):  # logged; the run's error is the one
                await shielded(self.terminate(sandbox_id))
            raise
        await shielded(self.terminate(sandbox_id))

    def _create(self, box: LocalSandbox) -> None:
        """The sandbox's folder (tags, held lock), then its cgroup."""
        try:
            box.home.mkdir(mode=0o700)
        except OSError as exc:
            raise ProviderError("could not create the sandbox's folder") from exc
        box.lock = os.open(box.home / _LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(box.lock, fcntl.LOCK_EX)
        tags = {**box.spec.tags, "created_at": time.time(), "lifetime_s": box.spec.lifetime_s}
        (box.home / _TAGS).write_text(json.dumps(tags))
        if self.isolation == "none":
            for part in ("work", "tmp"):
                (box.home / part).mkdir(mode=0o755)
        if self.tree is not None:
            limits = cgroups.GroupLimits(
                memory_bytes=(box.memory_mb + box.disk_mb) * _MIB,
                pids=self.settings.local_pids_max,
                cpus=box.spec.resources.cpu,
            )
            try:
                box.group = self.tree.create(box.id, limits)
            except OSError as exc:
                raise ProviderError("could not create the sandbox's cgroup") from exc

    async def list_owned(self) -> list[SandboxRef]:
        owned = []
        for home in self.root.iterdir():
            with contextlib.suppress(OSError, ValueError):
                tags = json.loads((home / _TAGS).read_text())
                if tags.get(TAG_CLUSTER) == self.cluster:
                    stamp = tags.get("created_at")
                    created = None if stamp is None else datetime.fromtimestamp(stamp, UTC)
                    owned.append(SandboxRef(home.name, tags.get(TAG_RUN), created_at=created))
        return owned

    async def terminate(self, sandbox_id: str) -> None:
        box = self._live.pop(sandbox_id, None)
        if box is not None:
            for process in box.processes:
                if process.returncode is None:
                    _kill_group(process.pid)
            for process in box.processes:
                with contextlib.suppress(ProcessLookupError):
                    await process.wait()
        # With bubblewrap, the processes we started and waited for took their whole PID
        # namespace with them; only a sandbox started elsewhere (another replica, a relay
        # that died) or without bubblewrap needs the /proc scan for strays.
        if box is None or self.isolation != "bwrap":
            for pid in await asyncio.to_thread(_marked_pids, sandbox_id):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        home = self.root / sandbox_id
        if PurePosixPath(sandbox_id).name != sandbox_id or sandbox_id in ("", ".", ".."):
            raise ProviderError("not a sandbox id")
        try:
            if self.tree is not None:
                group = self.tree.group(sandbox_id)
                if group.exists:
                    await asyncio.to_thread(group.remove)
            if box is not None and box.lock is not None:
                os.close(box.lock)
                box.lock = None
            if home.exists():
                await asyncio.to_thread(_remove_home, home)
        except OSError as exc:
            self.cleanup_failures += 1
            log.error(
                "local sandbox cleanup failed; the reaper retries it",
                extra={"sandbox_id": sandbox_id, "error_class": type(exc).__name__},
            )
            raise ProviderError("could not clean up the sandbox") from exc

    async def aclose(self) -> None:
        for sandbox_id in list(self._live):
            await self.terminate(sandbox_id)
        if self.tree is not None:  # this root's folder of groups, when no relay uses it
            for parent in self.tree.parents.values():
                with contextlib.suppress(OSError):
                    parent.rmdir()


async def _join_group(box: LocalSandbox, pid: int) -> None:
    """The first setup step: the job's processes live in the sandbox's cgroup."""
    if box.group is not None:
        box.group.add(pid)


async def _first_to_go(box: LocalSandbox, pid: int) -> None:
    """Out of memory, the kernel kills the sandbox before the relay (inherited by
    everything the job starts)."""
    _set_oom_score(pid)


def _set_oom_score(pid: int) -> None:
    Path(f"/proc/{pid}/oom_score_adj").write_text(OOM_SCORE_ADJ)


async def _attach_network(box: LocalSandbox, pid: int) -> None:
    """For ``egress = ["*"]``: the private network, attached to the sandbox's own network
    namespace before the job starts (without it the sandbox has only its loopback)."""
    tool = box.provider.network
    if not box.spec.egress.open or tool is None:
        return
    state = box.home / "network"
    state.mkdir(mode=0o700, exist_ok=True)
    # The tool is a host process that holds the sandbox's namespace open and outlives a
    # relay that dies: in the sandbox's group it ends with the sandbox, also when the next
    # relay sweeps the groups an earlier one left.
    adopt = box.group.add if box.group is not None else (lambda pid: None)
    box.network = await private_network.attach(pid, tool, box.provider.egress_allow, state, adopt)
