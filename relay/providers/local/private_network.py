"""The private network a local sandbox with ``egress = ["*"]`` gets: the public internet,
never the host.

Every bubblewrap sandbox has its own network namespace. For open egress the relay
attaches user-mode networking to it (``pasta`` from passt, else ``slirp4netns``): a tap
device whose traffic the tool replays through ordinary sockets of the relay's host, so
the sandbox reaches what the host reaches, minus what this module closes:

- the host's loopback: the namespace's ``127/8`` is its own, and the tools run without a
  gateway-to-host-loopback mapping (``--no-map-gw``, ``--disable-host-loopback``) or
  port forwarding;
- private, link-local (cloud metadata), CGNAT, multicast and reserved IPv4 ranges, and
  every address of the host's own interfaces (a whole network, where a local route makes
  the host answer for all of it): policy rules in the sandbox's namespace (``ip rule …
  unreachable``), looked up before any route. The relay adds them with
  ``nsenter ip -batch``; the job cannot remove them, for bubblewrap drops every
  capability and the namespace belongs to bubblewrap's user namespace, not the job's.
- the host's abstract unix sockets: they belong to a network namespace, and this is
  another one.

IPv4 only: pasta runs with ``-4`` and slirp4netns without ``--enable-ipv6``, so IPv6
leaves the sandbox nowhere. DNS goes to one address inside the sandbox (its
``resolv.conf`` says which) that the tool forwards to the host's first resolver, UDP
port 53 only.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path
from typing import Literal

BLOCKED = tuple(
    IPv4Network(cidr)
    for cidr in (
        "0.0.0.0/8",
        "10.0.0.0/8",
        "100.64.0.0/10",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "172.16.0.0/12",
        "192.0.0.0/24",
        "192.168.0.0/16",
        "198.18.0.0/15",
        "224.0.0.0/4",
        "240.0.0.0/4",
    )
)
"""Ranges a sandbox cannot reach unless the operator opens them (loopback never)."""

LOOPBACK = IPv4Network("127.0.0.0/8")
INTERFACE = "eth0"
PASTA_DNS = IPv4Address("169.254.0.53")
"""Where a pasta sandbox sends DNS; pasta forwards it to the host's resolver."""
SLIRP_DNS = IPv4Address("10.0.2.3")
"""slirp4netns's own DNS forwarder on its default 10.0.2.0/24 network."""

# Rule preferences: the DNS forwarder, then the host's own addresses (closed even inside
# an opened range), then the operator's openings, then the blocked ranges.
_PREF_DNS, _PREF_HOST, _PREF_ALLOW, _PREF_BLOCK = 100, 200, 300, 400
_NS_GET_USERNS = 0xB701  # ioctl: the user namespace that owns a namespace
_READY_TIMEOUT_S = 20.0
"""How long a tool, its rules or the sandbox's loopback may take: generous, for a busy host
must slow a run down, not fail it."""
_POLL_S = 0.002

Tool = Literal["pasta", "slirp4netns"]


@dataclass(frozen=True)
class NetworkTool:
    """The user-mode networking program found on this host."""

    name: Tool
    path: str

    @property
    def dns(self) -> IPv4Address:
        return PASTA_DNS if self.name == "pasta" else SLIRP_DNS

    def resolv_conf(self) -> str:
        """The sandbox's ``/etc/resolv.conf``: the host's would point at a closed address."""
        return f"nameserver {self.dns}\noptions edns0\n"


def available(choice: str = "auto", search_path: str | None = None) -> NetworkTool | None:
    """The tool to use (``pasta`` before ``slirp4netns`` for ``auto``), or None."""
    names: tuple[Tool, ...] = ("pasta", "slirp4netns")
    if choice == "off":
        return None
    for name in names:
        if choice in ("auto", name):
            path = shutil.which(name, path=search_path)
            if path is not None:
                return NetworkTool(name, path)
    return None


def host_addresses() -> list[IPv4Network]:
    """What this host's interfaces answer for (the kernel's local routes): an address each,
    or a whole network a local route holds."""
    with contextlib.suppress(OSError):
        return local_addresses(Path("/proc/net/fib_trie").read_text())
    return []


def local_addresses(fib_trie: str) -> list[IPv4Network]:
    """What ``/proc/net/fib_trie`` lists as ``LOCAL`` routes: ``/32`` an address, shorter
    a network the host answers for whole (an address on ``lo`` with its prefix, ``ip route
    add local …``: any address in it reaches the host's listeners).

    An entry (``/LEN SCOPE TYPE`` and maybe `` tos=N``) follows the ``|-- ADDRESS`` line of
    its key, and one key may list several (an address on two interfaces lists ``/32 host
    LOCAL`` twice): each belongs to the key above it, never to the line just before it.
    A table of its own (``Id 100:``) counts with its addresses only: it is looked up for
    what its ``ip rule`` picks, and a transparent proxy's ``local 0.0.0.0/0`` there (for
    marked packets) would close every destination."""
    found: set[IPv4Network] = set()
    key: IPv4Address | None = None
    whole = False
    """The table being read is one every lookup goes through (its networks count)."""
    for line in fib_trie.splitlines():
        text = line.strip()
        fields = text.split()
        if text.startswith("|-- "):
            try:
                key = IPv4Address(text[4:].strip())
            except ValueError:
                key = None
        elif text.startswith("+-- "):
            key = None
        elif text.endswith(":"):
            key, whole = None, text in ("Main:", "Local:")
        elif key is not None and len(fields) >= 3 and text.startswith("/") and fields[2] == "LOCAL":
            with contextlib.suppress(ValueError):
                network = IPv4Network(f"{key}{fields[0]}", strict=False)
                if whole or network.prefixlen == 32:
                    found.add(network)
    return sorted(found)


def rules(tool: NetworkTool, allow: Sequence[IPv4Network]) -> str:
    """The ``ip -batch`` script of policy rules that closes the sandbox's namespace."""
    lines = [f"rule add to {tool.dns} ipproto udp dport 53 lookup main pref {_PREF_DNS}"]
    lines += [
        f"rule add to {network} unreachable pref {_PREF_HOST}"
        for network in host_addresses()
        if not network.subnet_of(LOOPBACK)  # the sandbox's own loopback answers for these
    ]
    lines += [f"rule add to {network} lookup main pref {_PREF_ALLOW}" for network in allow]
    lines += [f"rule add to {network} unreachable pref {_PREF_BLOCK}" for network in BLOCKED]
    return "\n".join(lines) + "\n"


class NetworkError(Exception):
    """The private network could not be attached (the sandbox must not start)."""


@dataclass(frozen=True)
class Namespaces:
    """The sandbox's network namespace and the user namespace that owns it, as file
    descriptors the tools open as ``/proc/self/fd/N``.

    ``/proc/PID/ns/user`` is not the owner: bubblewrap switches to a nested user
    namespace to take the sandbox's uid, and joining that one instead (a race with the
    child) gives no right over the network namespace."""

    net: int
    user: int

    @property
    def fds(self) -> tuple[int, int]:
        return (self.net, self.user)

    @property
    def net_path(self) -> str:
        return f"/proc/self/fd/{self.net}"

    @property
    def user_path(self) -> str:
        return f"/proc/self/fd/{self.user}"

    @classmethod
    def of(cls, pid: int) -> Namespaces:
        net = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            user = fcntl.ioctl(net, _NS_GET_USERNS)
        except BaseException:
            os.close(net)
            raise
        return cls(net, user)

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)


@dataclass
class Attachment:
    """The networking process serving one sandbox; :meth:`close` ends it."""

    process: asyncio.subprocess.Process
    tool: NetworkTool
    seconds: float
    _closed: bool = field(default=False, repr=False)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGKILL)
        await self.process.wait()


def _pdeathsig() -> list[str]:
    """A prefix that kills the tool when the relay dies (it would keep the namespace)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []


async def _run_rules(spaces: Namespaces, script: str) -> None:
    nsenter = shutil.which("nsenter") or "nsenter"
    ip = shutil.which("ip") or "ip"
    command = [nsenter, f"--net={spaces.net_path}"]
    if os.geteuid() != 0:
        # The namespace belongs to bubblewrap's user namespace, which we own: entering it
        # gives the capabilities to add rules there (and only there).
        command += [f"--user={spaces.user_path}", "--preserve-credentials"]
    process = await asyncio.create_subprocess_exec(
        *command,
        ip,
        "-batch",
        "-",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
        pass_fds=spaces.fds,
    )
    try:
        communicate = process.communicate(script.encode())
        _, error = await asyncio.wait_for(communicate, _READY_TIMEOUT_S)
    except TimeoutError as exc:
        await _stop(process)
        raise NetworkError("the sandbox's network rules took too long") from exc
    except BaseException:  # a cancel (DELETE during creation): not left behind
        await _stop(process)
        raise
    if process.returncode != 0:
        raise NetworkError(f"could not close the sandbox's network: {error.decode()[-300:]}")


Adopt = Callable[[int], None]
"""Called with the tool's pid as soon as it exists (to put it in the sandbox's cgroup)."""


def _adopted(process: asyncio.subprocess.Process, adopt: Adopt) -> None:
    try:
        adopt(process.pid)
    except BaseException:
        process.kill()
        raise


async def _start_pasta(
    tool: NetworkTool, spaces: Namespaces, state: Path, adopt: Adopt
) -> asyncio.subprocess.Process:
    pidfile = state / "pasta.pid"
    pidfile.unlink(missing_ok=True)
    command = [
        *_pdeathsig(),
        tool.path,
        "--config-net",
        "--ipv4-only",
        "--no-map-gw",
        "--foreground",
        "--quiet",
        *("--tcp-ports", "none", "--udp-ports", "none"),
        *("--tcp-ns", "none", "--udp-ns", "none"),
        *("--ns-ifname", INTERFACE, "--dns-forward", str(PASTA_DNS)),
        *("--userns", spaces.user_path, "--netns", spaces.net_path, "--no-netns-quit"),
        *("--pid", str(pidfile)),
    ]
    if os.geteuid() == 0:
        # As root pasta drops to nobody first, who may not enter the sandbox's user
        # namespace (root made it); it still isolates itself once attached.
        command += ["--runas", "0:0"]
    with (state / "network.log").open("wb") as log:
        process = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            pass_fds=spaces.fds,
        )
    _adopted(process, adopt)
    # In the foreground pasta writes its PID file once the tap is configured.
    deadline = time.monotonic() + _READY_TIMEOUT_S
    try:
        while not (pidfile.exists() and pidfile.stat().st_size > 0):
            if process.returncode is not None or time.monotonic() > deadline:
                raise NetworkError(f"pasta did not start: {_tail(state / 'network.log')}")
            await asyncio.sleep(_POLL_S)
    except BaseException:  # also a cancel (DELETE during creation): pasta would stay
        await _stop(process)
        raise
    return process


async def _start_slirp(
    tool: NetworkTool, spaces: Namespaces, state: Path, adopt: Adopt
) -> asyncio.subprocess.Process:
    ready_read, ready_write = os.pipe()
    try:
        command = [
            *_pdeathsig(),
            tool.path,
            "--configure",
            "--disable-host-loopback",
            "--mtu=65520",
            f"--ready-fd={ready_write}",
            f"--userns-path={spaces.user_path}",
            "--netns-type=path",
            spaces.net_path,
            INTERFACE,
        ]
        with (state / "network.log").open("wb") as log:
            process = await asyncio.create_subprocess_exec(
                *command,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                pass_fds=(ready_write, *spaces.fds),
            )
        _adopted(process, adopt)
        os.close(ready_write)
        ready_write = -1
        reader = asyncio.to_thread(os.read, ready_read, 1)
        try:
            try:
                ready = await asyncio.wait_for(reader, _READY_TIMEOUT_S)
            except TimeoutError:
                ready = b""
            if ready != b"1":
                raise NetworkError(f"slirp4netns did not start: {_tail(state / 'network.log')}")
        except BaseException:  # also a cancel (DELETE during creation)
            await _stop(process)
            raise
        return process
    finally:
        os.close(ready_read)
        if ready_write >= 0:
            os.close(ready_write)


async def _stop(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGKILL)
    await process.wait()


def _tail(log: Path) -> str:
    with contextlib.suppress(OSError):
        lines = [
            line for line in log.read_text(errors="replace").splitlines() if "syslog" not in line
        ]
        return " ".join(lines)[-300:] or "no message"
    return "no message"


def _loopback_state(pid: int) -> Literal["up", "down", "unknown", "gone"]:
    try:
        lines = Path(f"/proc/{pid}/net/if_inet6").read_text().splitlines()
    except FileNotFoundError:  # IPv6 is off on this host: nothing to wait on
        return "unknown" if Path(f"/proc/{pid}").exists() else "gone"
    return "up" if any(line.endswith(" lo") for line in lines) else "down"


async def _loopback_ready(pid: int) -> None:
    """Wait until bubblewrap has brought up the sandbox's loopback.

    bubblewrap does it over netlink after reporting the PID, and checks that the answer
    is addressed to its own port id (its PID, 1); a tool's netlink socket opened in the
    namespace first can take that id, and bubblewrap then fails ("No child processes").
    The kernel gives an up loopback its ``::1``, which ``if_inet6`` shows.
    """
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while time.monotonic() < deadline:
        state = _loopback_state(pid)
        if state == "gone":
            raise NetworkError("the sandbox ended before its network was attached")
        if state != "down":
            return
        await asyncio.sleep(_POLL_S)
    raise NetworkError("the sandbox's loopback did not come up")


async def attach(
    pid: int,
    tool: NetworkTool,
    allow: Sequence[IPv4Network],
    state: Path,
    adopt: Adopt = lambda pid: None,
) -> Attachment:
    """Give the namespace of host process ``pid`` the private network; ``state`` is a
    host-only folder for the tool's PID file and log, ``adopt`` sees the tool's pid first
    thing. Close the result when done."""
    started = time.monotonic()
    script = rules(tool, allow)
    start = _start_pasta if tool.name == "pasta" else _start_slirp
    await _loopback_ready(pid)
    spaces = Namespaces.of(pid)
    try:
        # The tool first: its default route must resolve a gateway that is often in a
        # range the rules close (a cloud VPC's 10.x or 172.31.x, slirp4netns's 10.0.2.2).
        # The command is still blocked, so nothing runs before the rules are in.
        attachment = Attachment(await start(tool, spaces, state, adopt), tool, 0.0)
        try:
            await _run_rules(spaces, script)
        except BaseException:
            await attachment.close()
            raise
    finally:
        spaces.close()  # the tool holds its own references now
    attachment.seconds = time.monotonic() - started
    return attachment
