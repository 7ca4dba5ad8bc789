"""The embedded ``local`` provider: a sandbox on the relay's own machine.

With bubblewrap (``RELAY_LOCAL_ISOLATION=bwrap``, or ``auto`` when ``bwrap`` works):
a read-only view of the system (``/usr`` and a few harmless ``/etc`` files, never the
relay's own folder, token file or ``.env``), a private writable ``/workspace`` and
``/tmp``, new PID, user, IPC, UTS and network namespaces (the network is shared only for
``egress = ["*"]``), no capabilities, and ``--die-with-parent``: if the relay dies, its
sandboxes die with it, and when the command ends everything it spawned ends too.

Without it (``none``): a process group with rlimits, marked with ``SANDBOX_ID`` so a
``setsid`` child is still found and killed. That mode is **no security boundary** and
cannot keep a job off the network; ``auto`` refuses to run a no-network job in it,
while an explicit ``none`` is the operator's choice to run anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import resource
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import ClassVar

from relay.errors import EgressUnsupported, ProviderError, SandboxLost
from relay.providers.base import (
    DEFAULT_WORKDIR,
    TAG_CLUSTER,
    TAG_RUN,
    ExecResult,
    OutputSink,
    SandboxRef,
    SandboxSpec,
    shielded,
)
from relay.providers.spawn import Child, spawn
from relay.providers.spawn import close as close_child
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
    "passwd",
    "group",
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
_MARKER = "SANDBOX_ID"
_READ_CHUNK = 65_536
_PR_SET_PDEATHSIG = 1


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
    path = shutil.which("bwrap")
    if path is None:
        return False
    probe = [path, "--unshare-all", *_system_binds(), "--", "/usr/bin/true"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=10, check=False).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _limits(cpu_s: int, memory_mb: int) -> dict[str, tuple[int, int]]:
    """The rlimits of a sandbox's processes, by ``prlimit`` option name."""
    address_space = max(memory_mb, 256) * 1024 * 1024 * 2
    return {
        "cpu": (cpu_s, cpu_s + 1),
        "fsize": (1 << 30, 1 << 30),
        "as": (address_space, address_space),
    }


_RLIMITS = {"cpu": resource.RLIMIT_CPU, "fsize": resource.RLIMIT_FSIZE, "as": resource.RLIMIT_AS}


def _child_setup(cpu_s: int, memory_mb: int) -> Callable[[], None]:
    """Runs in the child before exec: die with the relay, and cap CPU, files and memory."""

    def setup() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        for name, limit in _limits(cpu_s, memory_mb).items():
            resource.setrlimit(_RLIMITS[name], limit)

    return setup


class LocalSandbox:
    """A private folder plus the processes started in it."""

    def __init__(self, provider: LocalProvider, sandbox_id: str, spec: SandboxSpec) -> None:
        self.id = sandbox_id
        self.provider = provider
        self.spec = spec
        self.home = provider.root / sandbox_id
        self.processes: list[Child] = []
        self.created = time.monotonic()

    def _host_path(self, path: str, workdir: str) -> Path:
        sandbox_path = PurePosixPath(workdir, path)  # an absolute path wins over workdir
        for inside, outside in (("/workspace", "work"), ("/tmp", "tmp")):  # noqa: S108
            if sandbox_path == PurePosixPath(inside) or sandbox_path.is_relative_to(inside):
                relative = sandbox_path.relative_to(inside)
                resolved = (self.home / outside / relative).resolve()
                if resolved.is_relative_to((self.home / outside).resolve()):
                    return resolved
        raise ProviderError(f"the local provider can write only under /workspace or /tmp: {path}")

    async def upload(self, files: Mapping[str, bytes]) -> None:
        for path, content in files.items():
            target = self._host_path(path, DEFAULT_WORKDIR)
            target.parent.mkdir(parents=True, exist_ok=True)
            await asyncio.to_thread(target.write_bytes, content)

    def _command(self, argv: Sequence[str], workdir: str) -> tuple[list[str], str | None]:
        if self.provider.isolation == "none":
            return list(argv), str(self._host_path(".", workdir))
        command = [self.provider.bwrap, "--die-with-parent", "--unshare-all", "--new-session"]
        if self.spec.egress.open:
            command.append("--share-net")
        command += ["--unshare-user", "--uid", "65534", "--gid", "65534", "--cap-drop", "ALL"]
        command += _system_binds()
        command += ["--bind", str(self.home / "work"), "/workspace"]
        command += ["--bind", str(self.home / "tmp"), "/tmp"]  # noqa: S108
        command += ["--chdir", workdir, "--", *argv]
        return command, None

    def launch(
        self, argv: Sequence[str], workdir: str, cpu_s: int
    ) -> tuple[list[str], str | None, Callable[[], None] | None]:
        """The argv, cwd and child setup that start ``argv`` in this sandbox.

        With bubblewrap, ``prlimit`` sets the limits and bwrap's ``--die-with-parent``
        ties the sandbox to the relay, so no Python runs in the child and the spawn can
        use vfork: a ``preexec_fn`` forces a full fork of the relay, 5-10 ms for a relay
        of ~100 MB, on every run. Without bubblewrap (or prlimit) the child setup does it.
        """
        command, cwd = self._command(argv, workdir)
        memory_mb = self.spec.resources.memory_mb
        if self.provider.isolation == "bwrap" and self.provider.prlimit is not None:
            limits = [
                f"--{name}={soft}:{hard}"
                for name, (soft, hard) in _limits(cpu_s, memory_mb).items()
            ]
            return [self.provider.prlimit, *limits, "--", *command], cwd, None
        return command, cwd, _child_setup(cpu_s, memory_mb)

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
        workdir = str(PurePosixPath(DEFAULT_WORKDIR, workdir or "."))
        self._host_path(".", workdir).mkdir(parents=True, exist_ok=True)
        # The sandbox's own hard deadline: even a relay that hangs cannot keep it alive.
        left = max(1, int(self.created + self.spec.lifetime_s - time.monotonic()))
        cpu_s = max(1, int(self.spec.lifetime_s))
        command, cwd, setup = self.launch(
            ["timeout", "-s", "KILL", str(left), *argv], workdir, cpu_s
        )
        job_env = {**_BASE_ENV, **env, _MARKER: self.id}
        if self.provider.isolation == "none":
            job_env["HOME"] = str(self.home / "work")
        try:
            process = await spawn(
                command, stdin=stdin is not None, env=job_env, cwd=cwd, preexec_fn=setup
            )
        except OSError as exc:
            raise ProviderError(f"could not start the command: {exc.strerror}") from exc
        self.processes.append(process)
        pumps = [
            asyncio.create_task(_pump(process.stdout, "stdout", output)),
            asyncio.create_task(_pump(process.stderr, "stderr", output)),
        ]
        if stdin is not None and process.stdin is not None:
            pumps.append(asyncio.create_task(_feed(process.stdin, stdin)))
        try:
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
        if not self.home.exists():
            raise SandboxLost("the sandbox was terminated during the run")
        return ExecResult(exit_code=code if code >= 0 else 128 - code)


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


class LocalProvider:
    """Sandboxes as bubblewrap jails (or plain process groups) on this machine."""

    name: ClassVar[str] = "local"

    def __init__(self, settings: Settings) -> None:
        self.cluster = settings.cluster
        self.explicit_none = settings.local_isolation == "none"
        if settings.local_isolation == "auto":
            self.isolation = "bwrap" if bwrap_works() else "none"
        else:
            self.isolation = settings.local_isolation
        self.bwrap = shutil.which("bwrap") or "bwrap"
        self.prlimit = shutil.which("prlimit")
        root = settings.local_root or Path(tempfile.gettempdir()) / f"relay-local-{self.cluster}"
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._live: dict[str, LocalSandbox] = {}
        if self.isolation == "none":
            log.warning(
                "local provider without bubblewrap: no security boundary, no egress control"
            )

    def check(self, spec: SandboxSpec) -> None:
        if spec.egress.open:
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
        home = self.root / sandbox_id
        for part in ("work", "tmp"):
            (home / part).mkdir(parents=True, mode=0o755)
        tags = {**spec.tags, "created_at": time.time(), "lifetime_s": spec.lifetime_s}
        (home / "tags.json").write_text(json.dumps(tags))
        box = LocalSandbox(self, sandbox_id, spec)
        self._live[sandbox_id] = box
        try:
            yield box
        finally:
            await shielded(self.terminate(sandbox_id))

    async def list_owned(self) -> list[SandboxRef]:
        owned = []
        for home in self.root.iterdir():
            with contextlib.suppress(OSError, ValueError):
                tags = json.loads((home / "tags.json").read_text())
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
        if home.is_relative_to(self.root) and home.exists():
            await asyncio.to_thread(shutil.rmtree, home, True)

    async def aclose(self) -> None:
        for sandbox_id in list(self._live):
            await self.terminate(sandbox_id)
