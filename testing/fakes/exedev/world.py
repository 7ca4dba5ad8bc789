"""The fake's state: VMs and the commands running on them, as real processes.

A VM's disk is a private host directory standing in for ``/``; a command sent through
``ssh`` is a real process run in it the way the Vercel and Sprites fakes run one
(:mod:`testing.fakes.vercel.jail`: bubblewrap when it works here, path mapping otherwise), by
the VM user's shell with ``-c``, in the home directory, as sshd would. exe.dev documents no
deadline for a command or a VM: neither ends here unless deleted, stopped or its request
dropped. Everything runs on the fake's event loop; the ledger is also read from other
threads.

A VM's processes are a VM's, not a command's: what a command starts in a session of its own
(``setsid``, as the SDK's ``spawn()`` does) outlives the ``ssh`` request, as it would on the
VM, until the VM is deleted, stopped or restarted. So commands get no PID namespace of their
own (they see the host's ``/proc``, read-only), and every process of a VM carries the
variable :data:`MARKER` with the VM's own value, by which the fake finds and kills them all
(a process that empties its environment escapes that: a fake's limit).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import tempfile
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from testing.fakes.exedev.ledger import Faults, Ledger, Token
from testing.fakes.vercel.jail import launch, prepare_root

HOME = "/home/exedev"
"""The VM user's home: the fake's choice (the SDK makes every relative path relative to it)."""
SHELL = "/bin/bash" if Path("/bin/bash").exists() else "/bin/sh"
MARKER = "EXE_FAKE_VM"
"""The variable that marks every process of a VM (its value is the VM's :attr:`FakeVM.marker`)."""


def kill_marked(marker: str) -> None:
    """SIGKILL every process whose environment carries ``MARKER=marker``: twice, for one
    forked while the first pass read ``/proc``."""
    needle = f"{MARKER}={marker}".encode()
    for _ in range(2):
        for environ in Path("/proc").glob("[0-9]*/environ"):
            try:
                if needle not in environ.read_bytes().split(b"\0"):
                    continue
                os.kill(int(environ.parent.name), signal.SIGKILL)
            except (OSError, ValueError):
                continue  # gone meanwhile, or not ours to read


@dataclass(eq=False)
class Session:
    """One ``ssh`` command: its process and the frames it produced, for one stream."""

    command: str
    process: asyncio.subprocess.Process | None = None
    frames: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    """("stdout" | "stderr", bytes), then ("exit_code", int) or ("error", str)."""
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    ended: bool = False

    def kill(self) -> None:
        """End the session as the VM does: kill the process it started for it (the shell,
        here through bubblewrap, whose child dies with it), not what that started. The SDK
        says so of exe.dev ("The VM kills the process it started for the session") and
        relies on it: its ``run()`` script's watchdog sees its parent go and kills the
        command's process group; anything started in a session of its own lives on."""
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.process.pid, signal.SIGKILL)

    def end(self, reason: str) -> None:
        """The VM went away under the command: kill it; its stream ends with an error."""
        if not self.ended:
            self.ended = True
            self.kill()
            self.frames.put_nowait(("error", reason))


@dataclass
class FakeVM:
    name: str
    root: Path
    tags: list[str]
    env: dict[str, str]
    image: str
    egress: str
    comment: str
    created_at: str
    created_by: str
    status: str = "running"
    marker: str = field(default_factory=lambda: secrets.token_hex(8))
    """The value of :data:`MARKER` in every process of this VM."""
    sessions: set[Session] = field(default_factory=set)
    timers: list[asyncio.TimerHandle] = field(default_factory=list)

    def record(self) -> dict[str, Any]:
        """The VM as ``ls`` and ``new`` report it (``exedev.types.VMRecord``/``NewResponse``)."""
        row: dict[str, Any] = {
            "vm_name": self.name,
            "ssh_dest": f"{self.name}.exe.xyz",
            "https_url": f"https://{self.name}.exe.xyz/",
            "status": self.status,
            "region": "fake",
            "region_display": "Fake region",
            "created_at": self.created_at,
            "egress_policy": self.egress,
        }
        if self.tags:
            row["tags"] = list(self.tags)
        if self.comment:
            row["comment"] = self.comment
        return row


class World:
    """All VMs the fake knows, by name, and the tokens it was told about."""

    def __init__(self) -> None:
        self.ledger = Ledger()
        self.faults = Faults()
        self.tokens: dict[str, Token] = {}
        self.base_dir = Path(tempfile.mkdtemp(prefix="fake-exedev-"))
        self.vms: dict[str, FakeVM] = {}
        self.hang = asyncio.Event()

    def issue_token(
        self,
        label: str,
        *,
        cmds: tuple[str, ...] | None = None,
        tag: str | None = None,
        expires_at: float | None = None,
    ) -> str:
        """A server-generated (``exe1``) token with these limits; any other bearer token but
        ``bad-key`` is an unlimited one."""
        token = f"exe1.{secrets.token_urlsafe(18)}"
        with self.ledger.lock:
            self.tokens[token] = Token(label, cmds, tag, expires_at)
        return token

    def token(self, bearer: str) -> Token:
        with self.ledger.lock:
            return self.tokens.get(bearer) or Token(label=bearer)

    def allocate(
        self,
        name: str,
        *,
        tags: list[str],
        env: dict[str, str],
        image: str,
        egress: str,
        comment: str,
        by: str,
        flags: dict[str, Any],
    ) -> FakeVM:
        root = self.base_dir / f"{name}-{secrets.token_hex(3)}"
        for directory in (HOME, "/tmp"):
            (root / directory.lstrip("/")).mkdir(parents=True, exist_ok=True)
        prepare_root(root)
        vm = FakeVM(
            name=name,
            root=root,
            tags=tags,
            env=env,
            image=image,
            egress=egress,
            comment=comment,
            created_at=datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
            created_by=by,
        )
        self.vms[name] = vm
        self.ledger.record_create(
            {
                "name": name,
                "tags": list(tags),
                "env_names": sorted(env),
                "image": image,
                "egress": egress,
                "flags": flags,
                "by": by,
            }
        )
        loop = asyncio.get_running_loop()
        if self.faults.vanish_after_s is not None:
            vm.timers.append(loop.call_later(self.faults.vanish_after_s, self.delete, name))
        if self.faults.stop_after_s is not None:
            vm.timers.append(loop.call_later(self.faults.stop_after_s, self.stop, name))
        return vm

    def delete(self, name: str, by: str = "fake") -> bool:
        """Kill every command of the VM and remove it; False if it did not exist."""
        vm = self.vms.pop(name, None)
        if vm is None:
            return False
        for timer in vm.timers:
            timer.cancel()
        for session in list(vm.sessions):
            session.end(f'VM "{name}" was deleted')
        kill_marked(vm.marker)
        shutil.rmtree(vm.root, ignore_errors=True)
        self.ledger.mark_gone(name, by)
        return True

    def stop(self, name: str) -> None:
        """The VM stops under its commands (as a crash would): they are killed, their streams
        end with an error, and it runs nothing until ``restart``."""
        vm = self.vms.get(name)
        if vm is None:
            return
        vm.status = "stopped"
        for session in list(vm.sessions):
            session.end(f'VM "{name}" stopped')
        kill_marked(vm.marker)

    def restart(self, name: str) -> None:
        vm = self.vms[name]
        for session in list(vm.sessions):
            session.end(f'VM "{name}" restarted')
        kill_marked(vm.marker)
        vm.status = "running"

    async def start(self, vm: FakeVM, command: str, by: str) -> Session:
        """Start ``command`` with the VM user's shell (exit 127 if it can't start)."""
        session = Session(command=command)
        vm.sessions.add(session)
        with self.ledger.lock:
            self.ledger.commands.append({"vm": vm.name, "command": command, "by": by})
        how = launch(
            vm.root,
            [SHELL, "-c", command],
            HOME,
            isolate_network=vm.egress != "all",
            own_pids=False,
        )
        home = HOME if how.cwd is None else str(vm.root / HOME.lstrip("/"))
        process_env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": home,
            "USER": "exedev",
            "LOGNAME": "exedev",
            "SHELL": SHELL,
            "LANG": "C.UTF-8",
            **vm.env,
            MARKER: vm.marker,
        }
        try:
            session.process = await asyncio.create_subprocess_exec(
                *how.argv,
                cwd=how.cwd,
                env=process_env,
                stdin=asyncio.subprocess.DEVNULL,  # the API has no stdin
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as exc:
            session.frames.put_nowait(("stderr", f"{SHELL}: {exc.strerror}\n".encode()))
            session.frames.put_nowait(("exit_code", 127))
            session.ended = True
            vm.sessions.discard(session)
            return session
        session.tasks.append(asyncio.create_task(_follow(vm, session)))
        return session

    async def shutdown(self) -> None:
        """Kill every process and remove every VM (the fake is going away)."""
        self.hang.set()
        for name in list(self.vms):
            sessions = list(self.vms[name].sessions)
            self.delete(name)
            for session in sessions:
                if session.process is not None:
                    await session.process.wait()
                await asyncio.gather(*session.tasks, return_exceptions=True)
        shutil.rmtree(self.base_dir, ignore_errors=True)


async def _follow(vm: FakeVM, session: Session) -> None:
    """Pump the process's output into frames; its exit code once its output has closed."""
    process = session.process
    assert process is not None
    pumps = [
        asyncio.create_task(_pump(session, process.stdout, "stdout")),
        asyncio.create_task(_pump(session, process.stderr, "stderr")),
    ]
    try:
        code = await process.wait()
        await asyncio.gather(*pumps)
    finally:
        session.kill()
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        vm.sessions.discard(session)
    if not session.ended:
        session.ended = True
        session.frames.put_nowait(("exit_code", code if code >= 0 else 128 - code))


async def _pump(session: Session, stream: asyncio.StreamReader | None, name: str) -> None:
    if stream is None:
        return
    while chunk := await stream.read(65536):
        if not session.ended:
            session.frames.put_nowait((name, chunk))
