"""How the local provider starts a command on the host: bubblewrap's options (the
read-only system binds, the sandbox's accounts), the rlimits, the memfds that carry options
and files, the ``setpriv`` wrapper in front of bubblewrap, and :class:`Invocation`, which
holds all of it until the command is spawned.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import shutil
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from relay.errors import ConfigError, ProviderError
from relay.providers.contract import DEFAULT_WORKDIR

_ETC_FILES = (
    "alternatives",
    "ssl",
    "ca-certificates",
    "ca-certificates.conf",
    "resolv.conf",
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
BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": DEFAULT_WORKDIR, "LANG": "C.UTF-8"}
"""A job's environment before its own variables and the sandbox marker."""
HOST_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
"""The whole environment of every host-side process the relay starts with bubblewrap."""
HOSTNAME = "sandbox"
"""The sandbox's host name (its own UTS namespace would otherwise copy the host's)."""
OWN_FILES = {
    "passwd": b"root:x:0:0:root:/root:/usr/sbin/nologin\n"
    b"nobody:x:65534:65534:nobody:/workspace:/usr/sbin/nologin\n",
    "group": b"root:x:0:\nnogroup:x:65534:\n",
    "hosts": f"127.0.0.1\tlocalhost {HOSTNAME}\n::1\tlocalhost ip6-localhost\n".encode(),
}
"""``/etc/passwd``, ``/etc/group`` and ``/etc/hosts`` inside a sandbox: the host's would
name its users and its internal hosts."""
_PR_SET_PDEATHSIG = 1
UNTIED_EXIT = 125
"""How a sandbox's first process ends when the relay died before it was tied to it."""
MIB = 1024 * 1024
WRITABLE = ("/workspace", "/tmp")  # noqa: S108
"""The sandbox's writable mounts (tmpfs), the only places uploads and workdirs may be."""


def system_binds() -> list[str]:
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
    probe = [path, "--unshare-all", *system_binds(), "--", "/usr/bin/true"]
    try:
        done = subprocess.run(probe, capture_output=True, timeout=10, check=False, env=HOST_ENV)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"bubblewrap did not run ({exc})"
    if done.returncode == 0:
        return None
    lines = done.stderr.decode(errors="replace").strip().splitlines()
    error = lines[-1] if lines else f"exit {done.returncode}"
    return f"bubblewrap fails here ({error}); {bwrap_fix(error)}"


def bwrap_blocks_userns(bwrap: str) -> bool:
    """True when this bubblewrap (0.8+) and kernel can keep a job from making user
    namespaces of its own (``--disable-userns``)."""
    options = ["--unshare-all", "--unshare-user", "--disable-userns", *system_binds()]
    probe = [bwrap, *options, "--", "/usr/bin/true"]
    try:
        done = subprocess.run(probe, capture_output=True, timeout=10, check=False, env=HOST_ENV)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def meminfo(memory_mb: int) -> bytes:
    """The sandbox's ``/proc/meminfo``: its own memory limit (``memory_mb``) as the total,
    not the host's.

    A fixed page (it does not follow use): programs size themselves by it (``free``, JVMs,
    thread pools), and the host's total told a job what machine it shares."""
    total = memory_mb * 1024
    fields = dict.fromkeys(_MEMINFO_FIELDS, 0) | dict.fromkeys(_MEMINFO_TOTALS, total)
    # The kernel's layout: name and colon in 15 columns, the number in 9.
    return "".join(f"{name + ':':<15}{fields[name]:>9} kB\n" for name in _MEMINFO_FIELDS).encode()


_MEMINFO_TOTALS = ("MemTotal", "MemFree", "MemAvailable")
_MEMINFO_FIELDS = (
    *_MEMINFO_TOTALS,
    *("Buffers", "Cached", "SwapCached", "Active", "Inactive", "SwapTotal", "SwapFree"),
    *("Dirty", "Writeback", "AnonPages", "Mapped", "Shmem", "Slab"),
)


def base_rlimits(cpu_s: int, memory_mb: int, open_files: int) -> dict[str, tuple[int, int]]:
    """The rlimits of a sandbox's processes, by ``prlimit`` option name.

    ``open_files`` is a sandbox's own, never the relay's: the relay raises its limit for
    its connections, and a sandbox inherited it (relay/providers/local/file_table.py)."""
    address_space = max(memory_mb, 256) * MIB * 2
    return {
        "cpu": (cpu_s, cpu_s + 1),
        "fsize": (1 << 30, 1 << 30),
        "as": (address_space, address_space),
        "nofile": (open_files, open_files),
    }


_RLIMITS = {
    "cpu": resource.RLIMIT_CPU,
    "fsize": resource.RLIMIT_FSIZE,
    "as": resource.RLIMIT_AS,
    "nofile": resource.RLIMIT_NOFILE,
    "nproc": resource.RLIMIT_NPROC,
}


def child_setup(
    limits: Mapping[str, tuple[int, int]], death_signal: int = signal.SIGKILL
) -> Callable[[], None]:
    """Runs in the forked child before exec: tie it to the relay (``death_signal`` when the
    relay dies), and apply the rlimits.

    The tie holds only if the relay is still the parent once it is made: a relay killed
    between the fork and the ``prctl`` has left the child to init already, whose death never
    comes. So the child checks its parent after tying itself, and ends if it changed."""
    relay = os.getpid()  # the relay's, read before the fork

    def setup() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, death_signal, 0, 0, 0)
        if os.getppid() != relay:
            os._exit(UNTIED_EXIT)
        for name, limit in limits.items():
            resource.setrlimit(_RLIMITS[name], limit)

    return setup


def sandbox_path(path: str, workdir: str) -> PurePosixPath:
    """An upload or workdir path inside the sandbox, which must be under a writable mount."""
    if "\0" in path:
        raise ProviderError("a path contains a NUL byte")
    normal = PurePosixPath(os.path.normpath(PurePosixPath(workdir, path)))
    for inside in WRITABLE:
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
        """What the child gets, under the same numbers: the memfds, the write end of the
        info pipe, and both ends of the block pipe (the write end is bubblewrap's
        ``--sync-fd``: held on the host side until the sandbox ends, the relay's death
        never reads as a release; bubblewrap's PID 1 keeps it, the job never sees it)."""
        ends = [self.info[1]] if self.info else []
        ends += list(self.block) if self.block else []
        return [fd for fd in (*self.fds, *ends) if fd not in self.closed]

    def _close(self, fd: int) -> None:
        if fd not in self.closed:
            self.closed.add(fd)
            with contextlib.suppress(OSError):
                os.close(fd)

    def close_child_ends(self) -> None:
        """Close, once the child has them, the fds the relay itself does not use (it keeps
        the info pipe's read end and the block pipe's write end)."""
        kept = {self.block[1]} if self.block else set()
        for fd in self.child_fds():
            if fd not in kept:
                self._close(fd)

    def close(self) -> None:
        self.close_child_ends()
        for pipe in (self.info, self.block):
            for fd in pipe or ():
                self._close(fd)


def memfd(name: str, content: bytes) -> int:
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


def refuse_nul(values: Sequence[str], what: str) -> None:
    if any("\0" in value for value in values):
        raise ProviderError(f"the {what} contains a NUL byte")


def find_setpriv() -> str:
    """``setpriv``, which starts every sandbox (:func:`host_wrapper`)."""
    setpriv = shutil.which("setpriv", path=HOST_ENV["PATH"])
    if setpriv is None:
        raise ConfigError(
            "the local provider needs setpriv (util-linux) to start bubblewrap; install it, "
            "or set RELAY_LOCAL_ISOLATION=none to run without isolation"
        )
    return setpriv


TIED = '[ "$PPID" = "$1" ] || exit 125; shift; exec "$@"'
"""The POSIX shell line between ``setpriv`` and ``timeout``: go on only if the relay (its
first argument) is still the parent, now that ``setpriv`` has tied this process to it."""


def host_wrapper(
    setpriv: str, uid: int | None, shell: str, timeout: str, lifetime_s: int
) -> list[str]:
    """What runs on the host in front of bubblewrap, one process exec'ing the next:

    * ``setpriv --pdeathsig ALRM`` ties the process to the relay; a relay running as root
      switches here to the sandbox's own ``uid`` (relay/providers/local/uids.py), for
      bubblewrap maps the sandbox's user to the user that starts it: an escape would
      otherwise be the host's root;
    * ``sh`` checks that the relay is still the parent (:data:`TIED`): a relay killed
      between the spawn and the tie left the process to init, whose death never comes,
      and nothing may start then;
    * ``timeout -s KILL`` keeps the sandbox's hard lifetime, and takes the tie's signal:
      ``ALRM`` is what its own timer sends, so the relay's death reads as the lifetime
      spent, and it kills bubblewrap and its whole process group (bubblewrap's child, the
      sandbox's PID 1, is in it until the job is released; after that the deathwatch,
      relay/providers/local/deathwatch.py, ends it). Killed outright, ``timeout`` would
      leave bubblewrap to its own ``--die-with-parent``, which it sets only once it has
      made its namespaces, and which its child sets only once released."""
    wrapper = [setpriv, "--pdeathsig=ALRM"]
    if uid is not None:
        wrapper += [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
        wrapper += ["--inh-caps=-all", "--bounding-set=-all"]
    elif os.geteuid() == 0:
        raise ProviderError("a sandbox of a relay running as root needs a uid of its own")
    tie = [shell, "-c", TIED, "relay-sandbox", str(os.getpid())]
    return [*wrapper, "--", *tie, timeout, "-s", "KILL", str(lifetime_s)]
