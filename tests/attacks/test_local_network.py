"""A job with ``egress = ["*"]`` on the ``local`` provider reaches the public internet
through its private network, never the host: not its loopback (the relay's own port),
not its abstract unix sockets, not its interface addresses, not private or link-local
ranges.

Private and link-local destinations are test hosts this module makes itself (network
namespaces joined to the host by veth pairs); a "public" one in 198.51.100.0/24 or
203.0.113.0/24 (documentation ranges the block list leaves open) shows that egress works
at all. Each
host's subnet is drawn at random among those no interface of this machine holds, so
another run's hosts (a suite beside this one, or one killed before it cleaned up) never
share one with these.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from ipaddress import IPv4Interface, IPv4Network
from pathlib import Path

import pytest

from relay.errors import EgressUnsupported
from relay.providers.contract import Egress, SandboxSpec
from relay.providers.local import private_network
from relay.providers.local.invocation import bwrap_works
from relay.providers.local.provider import LocalProvider
from testing.relay_server import RelayProcess
from tests.conftest import make_settings

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0
        or not bwrap_works()
        or private_network.available() is None
        or shutil.which("ip") is None,
        reason="needs root (for test hosts), bubblewrap and pasta or slirp4netns",
    ),
]

PORT = 8
"""The port every test host listens on."""

GREETER = """
import socket, sys
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("0.0.0.0", int(sys.argv[1])))
server.listen()
print("listening", flush=True)
while True:
    peer, _ = server.accept()
    peer.sendall(b"hello from " + sys.argv[2].encode() + b"\\n")
    peer.close()
"""

PROBE = """
import json, socket, sys
results = {}
for target in sys.argv[1:]:
    try:
        if target.startswith("@"):
            sock = socket.socket(socket.AF_UNIX)
            sock.settimeout(2)
            sock.connect("\\0" + target[1:])
        else:
            host, port = target.rsplit(":", 1)
            sock = socket.create_connection((host.strip("[]"), int(port)), timeout=2)
    except OSError as exc:
        results[target] = "refused " + type(exc).__name__
        continue
    try:  # connected: that alone is the leak; a greeting says who answered
        sock.settimeout(1)
        greeting = sock.recv(100).decode(errors="replace").strip()
    except OSError:
        greeting = ""
    sock.close()
    results[target] = ("reached " + greeting).strip()
print(json.dumps(results))
"""


@dataclass
class OwnHost:
    """A host with a greeter on ``PORT``, in its own network namespace."""

    name: str
    address: str
    host_side: str


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def _held_networks() -> list[IPv4Network]:
    """The IPv4 networks this machine's interfaces hold now."""
    shown = subprocess.run(
        ["ip", "-4", "-o", "addr", "show"], check=True, capture_output=True, text=True
    ).stdout
    return [IPv4Interface(line.split()[3]).network for line in shown.splitlines()]


def _free_plan() -> dict[str, tuple[str, str, int]]:
    """``kind: (address, host side, prefix length)``, each in a subnet no interface holds."""
    held = _held_networks()
    draws: dict[str, Callable[[], IPv4Network]] = {
        "private": lambda: IPv4Network(
            f"10.{random.randint(200, 254)}.{random.randint(0, 255)}.0/24"
        ),
        "link-local": lambda: IPv4Network(f"169.254.{random.randint(1, 168)}.0/24"),
        "public": lambda: IPv4Network(
            f"{random.choice(('198.51.100', '203.0.113'))}.{4 * random.randint(1, 62)}/30"
        ),
    }
    plan = {}
    for kind, draw in draws.items():
        for _ in range(100):
            network = draw()
            if not any(network.overlaps(other) for other in held):
                break
        else:
            pytest.fail(f"no free {kind} subnet for a test host")
        held.append(network)
        host_side, address = str(network[1]), str(network[2])
        plan[kind] = (address, host_side, network.prefixlen)
    return plan


@pytest.fixture(scope="module")
def test_hosts() -> Iterator[dict[str, OwnHost]]:
    tag = secrets.token_hex(2)
    plan = _free_plan()
    hosts: dict[str, OwnHost] = {}
    greeters: list[subprocess.Popen[bytes]] = []
    try:
        for index, (kind, (address, host_side, prefix)) in enumerate(plan.items()):
            name = f"rtn{tag}{index}"
            _ip("netns", "add", name)
            hosts[kind] = OwnHost(name, address, host_side)
            _ip("link", "add", f"{name}h", "type", "veth", "peer", "name", f"{name}n")
            _ip("link", "set", f"{name}n", "netns", name)
            _ip("addr", "add", f"{host_side}/{prefix}", "dev", f"{name}h")
            _ip("link", "set", f"{name}h", "up")
            _ip("-n", name, "addr", "add", f"{address}/{prefix}", "dev", f"{name}n")
            _ip("-n", name, "link", "set", f"{name}n", "up")
            _ip("-n", name, "link", "set", "lo", "up")
            greeter = subprocess.Popen(
                ["ip", "netns", "exec", name, sys.executable, "-c", GREETER, str(PORT), kind],
                stdout=subprocess.PIPE,
            )
            greeters.append(greeter)
            assert greeter.stdout is not None
            assert greeter.stdout.readline() == b"listening\n"
        yield hosts
    finally:
        for greeter in greeters:
            greeter.kill()
            greeter.wait()
            if greeter.stdout is not None:
                greeter.stdout.close()
        for host in hosts.values():
            subprocess.run(["ip", "netns", "del", host.name], check=False, timeout=10)
            # Deleting the namespace deleted the pair; this is for a half-made one.
            subprocess.run(
                ["ip", "link", "del", f"{host.name}h"],
                check=False,
                capture_output=True,
                timeout=10,
            )


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    server = RelayProcess(tmp_path_factory.mktemp("relay-net"), local_isolation="bwrap")
    server.add_token("ops", command=True)
    server.start()
    yield server
    server.stop()


def probe(relay: RelayProcess, *targets: str, command: list[str] | None = None) -> dict[str, str]:
    """What a job with open egress reaches of ``targets`` (``host:port`` or ``@abstract``)."""
    argv = command or ["python3", "probe.py", *targets]
    body = {"command": argv, "files": {"probe.py": PROBE}, "egress": ["*"], "timeout_s": 20}
    answer = relay.post(relay.tokens["ops"], body)
    run = answer.json()
    assert run.get("state") == "succeeded", run
    if command is not None:
        return {"stdout": run["stdout"]}
    results: dict[str, str] = json.loads(run["stdout"])
    return results


class Listener:
    """A host socket that records whether anyone connected."""

    def __init__(self, family: socket.AddressFamily, address: object) -> None:
        self.socket = socket.socket(family)
        if family == socket.AF_INET6:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        self.socket.bind(address)
        self.socket.listen()
        self.socket.settimeout(0.1)
        self.accepted = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._accept)
        self.thread.start()

    def _accept(self) -> None:
        while not self.done.is_set():
            try:
                peer, _ = self.socket.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            peer.sendall(b"host\n")
            peer.close()

    def close(self) -> None:
        self.done.set()
        self.thread.join()
        self.socket.close()


def test_test_hosts_answer_the_host(test_hosts: dict[str, OwnHost]) -> None:
    # Without this, "unreachable from the sandbox" would prove nothing.
    for kind, host in test_hosts.items():
        with socket.create_connection((host.address, PORT), timeout=2) as sock:
            assert sock.recv(100) == f"hello from {kind}\n".encode()


def test_open_egress_reaches_a_public_host(
    relay: RelayProcess, test_hosts: dict[str, OwnHost]
) -> None:
    target = f"{test_hosts['public'].address}:{PORT}"
    assert probe(relay, target) == {target: "reached hello from public"}


def test_private_and_link_local_hosts_are_unreachable(
    relay: RelayProcess, test_hosts: dict[str, OwnHost]
) -> None:
    targets = [f"{test_hosts[kind].address}:{PORT}" for kind in ("private", "link-local")]
    results = probe(relay, *targets)
    assert all(result.startswith("refused") for result in results.values()), results


def test_the_relays_own_port_on_host_loopback_is_unreachable(relay: RelayProcess) -> None:
    targets = [f"127.0.0.1:{relay.port}", f"127.0.0.2:{relay.port}", f"[::1]:{relay.port}"]
    results = probe(relay, *targets)
    assert all(result.startswith("refused") for result in results.values()), results


def test_the_hosts_own_addresses_are_unreachable(
    relay: RelayProcess, test_hosts: dict[str, OwnHost]
) -> None:
    listener = Listener(socket.AF_INET6, ("::", 0))
    port = listener.socket.getsockname()[1]
    try:
        addresses = [
            str(network.network_address)
            for network in private_network.host_addresses()
            if network.prefixlen == 32 and not network.is_loopback
        ]
        addresses += _host_ipv6_addresses()
        assert test_hosts["public"].host_side in addresses  # public, yet the host's own
        targets = [f"[{a}]:{port}" if ":" in a else f"{a}:{port}" for a in addresses]
        results = probe(relay, *targets)
    finally:
        listener.close()
    assert all(result.startswith("refused") for result in results.values()), results
    assert listener.accepted == 0


def test_an_address_the_host_holds_twice_is_unreachable(relay: RelayProcess) -> None:
    # One address on two interfaces (a VIP, an anycast address, another suite's test
    # hosts) is listed twice in the kernel's table: every open-egress run failed with
    # "could not set up the sandbox's limits".
    held = _held_networks()
    address = next(
        f"203.0.113.{last}"
        for last in random.sample(range(1, 255), 254)
        if not any(IPv4Network(f"203.0.113.{last}/32").overlaps(other) for other in held)
    )
    pair = f"rtd{secrets.token_hex(2)}"
    listener = Listener(socket.AF_INET, ("0.0.0.0", 0))
    port = listener.socket.getsockname()[1]
    try:
        _ip("link", "add", f"{pair}a", "type", "veth", "peer", "name", f"{pair}b")
        for end in ("a", "b"):
            _ip("addr", "add", f"{address}/32", "dev", f"{pair}{end}")
            _ip("link", "set", f"{pair}{end}", "up")
        assert private_network.host_addresses().count(IPv4Network(f"{address}/32")) == 1
        results = probe(relay, f"{address}:{port}")
    finally:
        subprocess.run(["ip", "link", "del", f"{pair}a"], check=False, capture_output=True)
        listener.close()
    assert results[f"{address}:{port}"].startswith("refused"), results
    assert listener.accepted == 0


def test_every_address_of_a_network_the_host_answers_for_whole_is_unreachable(
    relay: RelayProcess,
) -> None:
    # A local route for a whole network (an address on lo with its prefix, `ip route add
    # local`: AnyIP) makes the host answer at every address of it, listed once as
    # "/30 host LOCAL": only "/32 host LOCAL" was read, so the host's listeners were open to
    # every open-egress sandbox at the network's other addresses.
    held = _held_networks()
    network = next(
        candidate
        for candidate in (
            IPv4Network(f"203.0.113.{4 * last}/30") for last in random.sample(range(1, 63), 62)
        )
        if not any(candidate.overlaps(other) for other in held)
    )
    pair = f"rtl{secrets.token_hex(2)}"
    listener = Listener(socket.AF_INET, ("0.0.0.0", 0))
    port = listener.socket.getsockname()[1]
    target = f"{network[2]}:{port}"  # no interface's address: the local route's alone
    try:
        _ip("link", "add", f"{pair}a", "type", "veth", "peer", "name", f"{pair}b")
        _ip("addr", "add", f"{network[1]}/30", "dev", f"{pair}a")  # the network shows held
        _ip("link", "set", f"{pair}a", "up")
        _ip("route", "add", "local", str(network), "dev", f"{pair}a", "table", "local")
        assert network in private_network.host_addresses()
        results = probe(relay, target)
    finally:
        subprocess.run(["ip", "link", "del", f"{pair}a"], check=False, capture_output=True)
        listener.close()
    assert results[target].startswith("refused"), results
    assert listener.accepted == 0


def test_host_abstract_unix_sockets_are_unreachable(relay: RelayProcess) -> None:
    name = f"relay-test-{secrets.token_hex(4)}"
    listener = Listener(socket.AF_UNIX, "\0" + name)
    try:
        results = probe(relay, "@" + name)
    finally:
        listener.close()
    assert results["@" + name].startswith("refused"), results
    assert listener.accepted == 0


def test_the_job_cannot_lift_the_blocks(relay: RelayProcess) -> None:
    script = "ip rule del pref 400; ip route del default; ip rule flush; ip rule"
    output = probe(relay, command=["sh", "-c", f"{{ {script}; }} 2>&1"])["stdout"]
    assert output.count("Operation not permitted") == 3, output
    assert "to 10.0.0.0/8 unreachable" in output and "to 169.254.0.0/16" in output


def test_without_a_networking_tool_open_egress_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bwrap", "prlimit"):
        (bin_dir / tool).symlink_to(shutil.which(tool) or tool)
    monkeypatch.setenv("PATH", str(bin_dir))
    provider = LocalProvider(make_settings(tmp_path, local_isolation="bwrap"))
    spec = SandboxSpec(run_id="run_net", cluster="test", timeout_s=5, egress=Egress(("*",)))
    with pytest.raises(EgressUnsupported, match="passt"):
        provider.check(spec)
    monkeypatch.undo()
    provider = LocalProvider(make_settings(tmp_path, local_network="off"))
    with pytest.raises(EgressUnsupported):
        provider.check(spec)


def _host_ipv6_addresses() -> list[str]:
    found = []
    for line in Path("/proc/net/if_inet6").read_text().splitlines():
        raw, _, _, scope, *_ = line.split()
        if scope == "00":  # global: link-local needs a zone, loopback is the sandbox's
            found.append(str(socket.inet_ntop(socket.AF_INET6, bytes.fromhex(raw))))
    return found
