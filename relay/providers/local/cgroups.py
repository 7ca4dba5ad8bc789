"""One cgroup per local sandbox: its memory, process count and CPU, enforced by the kernel.

:func:`detect` finds what this host lets the relay use and returns a :class:`CgroupTree`
(or ``None`` and the reason). Two implementations stand behind one interface:

* **v1** (separate ``memory``, ``pids`` and ``cpu`` hierarchies, as on this project's CI):
  sandbox groups live under the relay's own group in each hierarchy,
  ``<own>/relay-sandboxes/<root key>/<sandbox id>``;
* **v2** (the unified hierarchy, production with systemd's ``Delegate=yes``): the relay
  moves itself into the leaf ``<own>/relay`` (a v2 group with controllers enabled for
  its children may hold no process), enables ``+memory +pids +cpu`` below ``<own>``,
  and makes ``<own>/sandboxes/<root key>/<sandbox id>``.

The root key is a digest of the sandbox root, so two relays on one host with different
roots never sweep each other's groups. The memory limit has no swap (v1
``memory.memsw.limit_in_bytes`` where the kernel has it, and ``memory.swappiness = 0``;
v2 ``memory.swap.max = 0``); tmpfs pages written by the sandbox are charged to it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

MOUNT = Path("/sys/fs/cgroup")
CPU_PERIOD_US = 100_000
_KILL_ROUNDS = 200


@dataclass(frozen=True)
class GroupLimits:
    """What one sandbox may use."""

    memory_bytes: int
    pids: int
    cpus: float


def root_key(root: Path) -> str:
    """The name of a sandbox root's folder of groups (stable for one root path)."""
    return hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:12]


def _write(path: Path, value: str) -> None:
    path.write_text(value)


def _read_count(path: Path, key: str) -> int:
    """The number after ``key`` in a ``key value`` file (0 when absent)."""
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return 0


def _pids(procs: Path) -> list[int]:
    try:
        return [int(line) for line in procs.read_text().split()]
    except FileNotFoundError:
        return []


def _kill_all(procs: Path) -> None:
    """SIGKILL every process listed in ``procs`` until it is empty (forks race the kill)."""
    for _ in range(_KILL_ROUNDS):
        pids = _pids(procs)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.005)
    raise OSError(errno.EBUSY, f"processes are still in {procs.parent}")


def _rmdir(path: Path) -> None:
    # A killed process leaves its group a moment after it is reaped: retry briefly.
    for _ in range(_KILL_ROUNDS):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
            time.sleep(0.005)
    path.rmdir()


class SandboxGroup:
    """One sandbox's group: one folder per hierarchy (v1) or a single folder (v2)."""

    def __init__(self, folders: dict[str, Path], version: str) -> None:
        self.folders = folders
        self.version = version

    @property
    def exists(self) -> bool:
        return any(folder.is_dir() for folder in self.folders.values())

    def add(self, pid: int) -> None:
        """Move ``pid`` (and so everything it starts) into the group."""
        for folder in self.folders.values():
            _write(folder / "cgroup.procs", str(pid))

    def oom_kills(self) -> int:
        """How many processes the kernel killed for exceeding the memory limit."""
        if self.version == "v1":
            return _read_count(self.folders["memory"] / "memory.oom_control", "oom_kill")
        return _read_count(self.folders["memory"] / "memory.events", "oom_kill")

    def kill(self) -> None:
        """Kill every process in the group and wait until it is empty."""
        for folder in self.folders.values():
            if not folder.is_dir():
                continue
            kill_file = folder / "cgroup.kill"
            if self.version == "v2" and kill_file.exists():
                with contextlib.suppress(FileNotFoundError):
                    _write(kill_file, "1")
            _kill_all(folder / "cgroup.procs")

    def remove(self) -> None:
        """Kill what is left and remove the group."""
        self.kill()
        for folder in self.folders.values():
            _rmdir(folder)


CONTROLLERS_V2 = ("cpu", "memory", "pids")
"""The v2 controllers the relay's sandboxes need, delegated to it."""
ENABLE_V2 = " ".join(f"+{name}" for name in CONTROLLERS_V2)
"""What a v2 folder of the relay's hands down to its children (``cgroup.subtree_control``)."""


class CgroupTree:
    """Where a relay's sandbox groups live, for one sandbox root."""

    version: str
    controllers: frozenset[str]

    def __init__(self, parents: dict[str, Path], version: str) -> None:
        self.parents = parents  # controller (v1) or "memory" (v2, all in one) -> folder
        self.version = version
        self.controllers = frozenset({"memory", "pids", "cpu"})

    def group(self, sandbox_id: str) -> SandboxGroup:
        return SandboxGroup(
            {name: parent / sandbox_id for name, parent in self.parents.items()}, self.version
        )

    def names(self) -> set[str]:
        """The sandbox ids that have a group under this root."""
        found: set[str] = set()
        for parent in self.parents.values():
            with contextlib.suppress(OSError):
                found |= {entry.name for entry in parent.iterdir() if entry.is_dir()}
        return found

    def create(self, sandbox_id: str, limits: GroupLimits) -> SandboxGroup:
        try:
            return self._create(sandbox_id, limits)
        except FileNotFoundError:
            # The folder of groups is gone: another process on this sandbox root (`relay
            # probe local`, `relay reap`) removes it as it closes when it finds it empty.
            self._make_parents()
            return self._create(sandbox_id, limits)

    def _make_parents(self) -> None:
        for parent in self.parents.values():
            parent.mkdir(parents=True, exist_ok=True)
            if self.version == "v2":  # as tree_v2 made it: its children get the controllers
                _write(parent / "cgroup.subtree_control", ENABLE_V2)

    def _create(self, sandbox_id: str, limits: GroupLimits) -> SandboxGroup:
        group = self.group(sandbox_id)
        try:
            for folder in group.folders.values():
                folder.mkdir(mode=0o755)
            if self.version == "v1":
                self._limit_v1(group.folders, limits)
            else:
                self._limit_v2(group.folders["memory"], limits)
        except BaseException:
            with contextlib.suppress(OSError):
                group.remove()
            raise
        return group

    @staticmethod
    def _limit_v1(folders: dict[str, Path], limits: GroupLimits) -> None:
        memory = folders["memory"]
        _write(memory / "memory.limit_in_bytes", str(limits.memory_bytes))
        if (memory / "memory.memsw.limit_in_bytes").exists():
            _write(memory / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
        with contextlib.suppress(OSError):  # refused in a group under a non-default parent
            _write(memory / "memory.swappiness", "0")
        _write(folders["pids"] / "pids.max", str(limits.pids))
        cpu = folders["cpu"]
        _write(cpu / "cpu.cfs_period_us", str(CPU_PERIOD_US))
        _write(cpu / "cpu.cfs_quota_us", str(int(limits.cpus * CPU_PERIOD_US)))

    @staticmethod
    def _limit_v2(folder: Path, limits: GroupLimits) -> None:
        _write(folder / "memory.max", str(limits.memory_bytes))
        _write(folder / "memory.swap.max", "0")
        _write(folder / "memory.oom.group", "1")  # an OOM kill ends the whole sandbox
        _write(folder / "pids.max", str(limits.pids))
        _write(folder / "cpu.max", f"{int(limits.cpus * CPU_PERIOD_US)} {CPU_PERIOD_US}")


def _own_paths(proc_cgroup: str) -> dict[str, str]:
    """``/proc/self/cgroup`` as {controller: path}; the v2 line's key is ``""``."""
    paths: dict[str, str] = {}
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(","):
            paths[name] = path
    return paths


def tree_v1(root: Path, mount: Path, proc_cgroup: str) -> CgroupTree:
    """The v1 tree: ``<mount>/<controller><own>/relay-sandboxes/<root key>`` each."""
    own = _own_paths(proc_cgroup)
    parents: dict[str, Path] = {}
    for name in ("memory", "pids", "cpu"):
        if name not in own:
            raise OSError(errno.ENOENT, f"no v1 {name} hierarchy")
        parent = mount / name / own[name].lstrip("/") / "relay-sandboxes" / root_key(root)
        parent.mkdir(parents=True, exist_ok=True)
        parents[name] = parent
    return CgroupTree(parents, "v1")


def tree_v2(root: Path, mount: Path, proc_cgroup: str, pid: int | None = None) -> CgroupTree:
    """The v2 tree: move this process into ``<own>/relay`` and delegate below ``<own>``."""
    own = mount / _own_paths(proc_cgroup)[""].lstrip("/")
    if own.name == "relay" and (own.parent / "sandboxes").is_dir():
        own = own.parent  # this process moved itself already (a second provider)
    wanted = set(CONTROLLERS_V2)
    available = set((own / "cgroup.controllers").read_text().split())
    if not wanted <= available:
        missing = " ".join(sorted(wanted - available))
        raise OSError(errno.EOPNOTSUPP, f"controllers not delegated: {missing}")
    leaf = own / "relay"
    leaf.mkdir(exist_ok=True)
    _write(leaf / "cgroup.procs", str(pid if pid is not None else os.getpid()))
    _write(own / "cgroup.subtree_control", ENABLE_V2)
    parent = own / "sandboxes"
    for folder in (parent, parent / root_key(root)):
        folder.mkdir(exist_ok=True)
        _write(folder / "cgroup.subtree_control", ENABLE_V2)
    return CgroupTree({"memory": parent / root_key(root)}, "v2")


def detect(root: Path, mount: Path = MOUNT) -> tuple[CgroupTree | None, str]:
    """The cgroup tree for sandboxes under ``root``, or ``None`` and why not."""
    try:
        proc_cgroup = Path("/proc/self/cgroup").read_text()
        if (mount / "cgroup.controllers").exists():  # the unified hierarchy alone
            return tree_v2(root, mount, proc_cgroup), "v2"
        return tree_v1(root, mount, proc_cgroup), "v1"
    except (OSError, ValueError, KeyError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return None, reason
