"""The local provider (:class:`LocalProvider`): its isolation and limits as found at
startup, the check of a sandbox's egress, a sandbox's life (folder, lock, cgroup, the
terminate that kills and removes them), the sandboxes it owns, and the setup steps run
before each job starts (the OOM score, the cgroup, the private network).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import secrets
import shutil
import signal
import stat
import time
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import ClassVar

from relay.cancellation import shielded
from relay.errors import ConfigError, EgressUnsupported, ProviderError, ProviderRateLimited
from relay.providers.contract import TAG_CLUSTER, TAG_RUN, Rate, SandboxRef, SandboxSpec
from relay.providers.lifecycle import SandboxProvider
from relay.providers.local import cgroups, file_table, private_network, uids
from relay.providers.local.deathwatch import Deathwatch
from relay.providers.local.invocation import (
    HOST_ENV,
    MIB,
    base_rlimits,
    bwrap_blocks_userns,
    bwrap_problem,
    bwrap_works,
    find_setpriv,
)
from relay.providers.local.root import (
    ENDING_FILE,
    LOCK_FILE,
    TAGS_FILE,
    check_root,
    kill_group,
    lock_held,
    marked_pids,
    remove_home,
    sandbox_root,
)
from relay.providers.local.sandbox import LocalSandbox, SetupStep
from relay.settings import ProviderSettings, Settings

log = logging.getLogger("relay.providers.local")

OOM_SCORE_ADJ = "1000"
"""A sandbox's processes are the first the kernel kills when the host (or the relay's
unit) runs out of memory, never the relay."""


class LocalProvider(SandboxProvider[LocalSandbox]):
    """Sandboxes as bubblewrap jails (or plain process groups) on this machine.

    A driver on the shared lifecycle like every provider; its create undoes itself when it
    fails (a folder may exist before its tags do, and the base's sweep finds sandboxes by
    their tags)."""

    name: ClassVar[str] = "local"
    label: ClassVar[str] = "local"
    rate: ClassVar[Rate] = Rate(0.0, 0.0)  # the operator's own machine
    # Built in: its RELAY_LOCAL_* settings are the relay's own (the CLI reads them too).
    settings_model: ClassVar[type[ProviderSettings] | None] = None
    terminate_timeout_s: ClassVar[float] = 60.0
    """Killing a process tree, waiting for it and removing its cgroup and tmpfs-backed
    folder can be slow on a loaded host; one cut short is left to the reaper."""
    skips_warm_pools: ClassVar[str | None] = (
        "local's create (a folder and a cgroup, ~1.2 ms) costs less than a pool's claim "
        "(~1.6 ms), and the job's process starts with its command, so a pool saves nothing"
    )
    """Measured by ``python -m bench.pools`` (bench/README.md, (5)): a pooled run was no
    faster, and up to 1.45x slower on a loaded machine."""

    def __init__(self, settings: Settings, *, reaping: bool = False) -> None:
        self.cluster = settings.cluster
        self.reaping = reaping
        """Built for ``relay reap`` (:meth:`for_reaper`): what an earlier relay left is not
        swept at start but listed ``abandoned``, and no sandbox is created."""
        self.settings = settings
        self.create_timeout_s = settings.create_timeout_s
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
        # A user namespace of its own gives a job every capability over the namespaces it
        # then makes (nftables, mounts...): kernel surface no job needs.
        self.disable_userns = self.isolation == "bwrap" and bwrap_blocks_userns(self.bwrap)
        if self.isolation == "bwrap" and not self.disable_userns:
            log.warning(
                "local provider: this bubblewrap cannot stop jobs from making user "
                "namespaces (--disable-userns needs bubblewrap 0.8 or later)"
            )
        self.network = private_network.available(settings.local_network)
        self.egress_allow = list(settings.local_egress_allow)
        self.prlimit = shutil.which("prlimit", path=HOST_ENV["PATH"])
        self.setpriv = find_setpriv() if self.isolation == "bwrap" else "setpriv"
        self.timeout = shutil.which("timeout", path=HOST_ENV["PATH"]) or "timeout"
        self.shell = shutil.which("sh", path=HOST_ENV["PATH"]) or "/bin/sh"
        self.deathwatch = Deathwatch(self.shell, dict(HOST_ENV))
        """Kills what a relay killed outright leaves of a sandbox being released."""
        self.nsenter = shutil.which("nsenter", path=HOST_ENV["PATH"]) or "nsenter"
        """Reads a sandbox's files in its own view (relay/providers/local/files.py)."""
        self.root = sandbox_root(settings)
        check_root(self.root)
        self.max_sandboxes = min(settings.local_max_sandboxes, settings.max_concurrent)
        self.budget = file_table.fit(
            file_table.file_max(),
            self.max_sandboxes,
            settings.local_pids_max,
            settings.local_open_files,
        )
        if self.budget.lowered is not None:
            log.warning(self.budget.lowered)
        self.uids: uids.UidRange | None = None
        """A root relay's sandbox uids (set below, once an earlier relay's leftovers are
        gone; none when reaping, which creates nothing)."""
        self._held: dict[str, uids.HeldUid] = {}
        """The uid each sandbox runs as, released once its cleanup succeeded."""
        self._live: dict[str, LocalSandbox] = {}
        self._commands = 0
        """Sandboxes running a command now: only they hold processes and files."""
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
            if not reaping:
                self._sweep_leftovers()
        if reaping:
            return
        # After the sweep: a sandbox a relay killed with SIGKILL left running still holds
        # its uid, and is no other program's use of the range.
        self.uids = uids.for_sandboxes(settings.local_uids, self.max_sandboxes + settings.pool_max)
        self.setup_steps.append(_attach_network)

    @classmethod
    def for_reaper(cls, settings: Settings) -> LocalProvider:
        return cls(settings, reaping=True)

    def start_command(self) -> None:
        """Count a sandbox's command in, or refuse it past ``max_sandboxes``: the host's
        file table is budgeted for that many (file_table.py)."""
        if self._commands >= self.max_sandboxes:
            raise ProviderRateLimited(
                "the local provider already runs as many sandboxes as it may at once "
                f"({self.max_sandboxes})",
                retry_after=1.0,
            )
        self._commands += 1

    def end_command(self) -> None:
        self._commands -= 1

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
            "uid": "per-sandbox" if self.uids is not None else "relay",
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
        limits = base_rlimits(cpu_s, memory_mb, self.budget.open_files)
        if self.tree is None and self.isolation == "bwrap":
            pids = self.budget.pids
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

    def _leftovers(self) -> set[str]:
        """The sandbox groups an earlier relay on this root left (a sandbox whose lock
        nobody holds, or whose folder is gone): its processes may still run. Only looks."""
        tree = self.tree
        if tree is None:
            return set()
        # A terminate removes the group before it lets go of the lock: a group still there
        # once its lock is free is no live relay's.
        return {
            name
            for name in tree.names()
            if not lock_held(self.root / name) and tree.group(name).exists
        }

    def _sweep_leftovers(self) -> None:
        """Kill what an earlier relay on this root left in its sandbox groups, before the
        uids are checked (:meth:`_leftovers`; ``relay reap`` lists them instead)."""
        assert self.tree is not None
        swept = 0
        for sandbox_id in self._leftovers():
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

    async def create(self, spec: SandboxSpec) -> LocalSandbox:
        if self.reaping:
            raise ProviderError("the local provider built for the reaper creates no sandbox")
        sandbox_id = f"lcl-{spec.run_id.removeprefix('run_')}-{secrets.token_hex(3)}"
        box = LocalSandbox(self, sandbox_id, spec)
        self._live[sandbox_id] = box
        try:
            if self.uids is not None:
                box.uid = self._held[sandbox_id] = self.uids.take()
            self._make(box)
        except BaseException:
            with contextlib.suppress(ProviderError):  # logged; the create's error is the one
                await shielded(self.terminate(sandbox_id))
            raise
        return box

    def may_have_created(self, error: ProviderError) -> bool:
        return False  # a failed create has already undone itself

    def _make(self, box: LocalSandbox) -> None:
        """The sandbox's folder (tags, held lock), then its cgroup."""
        try:
            box.home.mkdir(mode=0o700)
        except OSError as exc:
            raise ProviderError("could not create the sandbox's folder") from exc
        box.lock = os.open(box.home / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(box.lock, fcntl.LOCK_EX)
        tags = {**box.spec.tags, "created_at": time.time(), "lifetime_s": box.spec.lifetime_s}
        (box.home / TAGS_FILE).write_text(json.dumps(tags))
        if self.isolation == "none":
            for part in ("work", "tmp"):
                (box.home / part).mkdir(mode=0o755)
        if self.tree is not None:
            limits = cgroups.GroupLimits(
                memory_bytes=(box.memory_mb + box.disk_mb) * MIB,
                pids=self.budget.pids,
                cpus=box.spec.resources.cpu,
            )
            try:
                box.group = self.tree.create(box.id, limits)
            except OSError as exc:
                raise ProviderError("could not create the sandbox's cgroup") from exc

    async def list_tagged(self) -> list[SandboxRef]:
        """This cluster's sandboxes under the root, and the groups an earlier relay left
        (``abandoned``; one whose folder is gone, with no run)."""
        left = self._leftovers()
        owned, others = [], set()
        for home in self.root.iterdir():
            with contextlib.suppress(OSError, ValueError):
                tags = json.loads((home / TAGS_FILE).read_text())
                if tags.get(TAG_CLUSTER) != self.cluster:
                    others.add(home.name)
                    continue
                stamp = tags.get("created_at")
                created = None if stamp is None else datetime.fromtimestamp(stamp, UTC)
                ref = SandboxRef(
                    home.name, tags.get(TAG_RUN), created_at=created, abandoned=home.name in left
                )
                owned.append(ref)
        listed = {ref.sandbox_id for ref in owned} | others
        owned += [SandboxRef(name, None, abandoned=True) for name in sorted(left - listed)]
        return owned

    async def destroy(self, sandbox_id: str) -> None:
        home = self.root / sandbox_id
        if PurePosixPath(sandbox_id).name != sandbox_id or sandbox_id in ("", ".", ".."):
            raise ProviderError("not a sandbox id")
        with contextlib.suppress(OSError):  # a folder already gone: nothing runs there
            (home / ENDING_FILE).touch()
        box = self._live.pop(sandbox_id, None)
        if box is not None:
            box.hold_view(None)  # its mounts (and their memory) go with the namespaces
            for process in box.processes:
                if process.returncode is None:
                    kill_group(process.pid)
            for process in box.processes:
                with contextlib.suppress(ProcessLookupError):
                    await process.wait()
        # With bubblewrap, the processes we started and waited for took their whole PID
        # namespace with them; only a sandbox started elsewhere (another replica, a relay
        # that died) or without bubblewrap needs the /proc scan for strays.
        if box is None or self.isolation != "bwrap":
            for pid in await asyncio.to_thread(marked_pids, sandbox_id):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        try:
            if self.tree is not None:
                group = self.tree.group(sandbox_id)
                if group.exists:
                    await asyncio.to_thread(group.remove)
            if box is not None and box.lock is not None:
                os.close(box.lock)
                box.lock = None
            if home.exists():
                await asyncio.to_thread(remove_home, home)
        except OSError as exc:
            self.cleanup_failures += 1  # logged by the base's terminate
            raise ProviderError("could not clean up the sandbox") from exc
        # Only now is nothing of the sandbox left to run as its uid.
        held = self._held.pop(sandbox_id, None)
        if held is not None:
            held.release()

    async def aclose(self) -> None:
        for sandbox_id in list(self._live):
            await self.terminate(sandbox_id)
        # A sandbox whose cleanup failed kept its uid for the reaper's retry; closing, the
        # relay lets go of it as its death would (the next relay's startup check and its
        # group sweep see what is left).
        for held in self._held.values():
            held.release()
        self._held.clear()
        self.deathwatch.close()
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
