"""The host's own addresses, read off ``/proc/net/fib_trie``: the sandbox's private network
closes each of them, so a misread one fails every open-egress run on that host."""

from __future__ import annotations

from ipaddress import IPv4Network

import pytest

from relay.providers.local import private_network

# As Linux 6.1 prints it with 10.99.0.1/24 on both ends of a veth pair (read off this
# machine): one key, two entries each.
TWICE = """\
Main:
  +-- 0.0.0.0/0 3 0 5
     |-- 0.0.0.0
        /0 universe UNICAST
     +-- 10.99.0.0/24 2 0 2
        +-- 10.99.0.0/31 1 0 0
           |-- 10.99.0.0
              /24 link UNICAST
              /24 link UNICAST
           |-- 10.99.0.1
              /32 host LOCAL
              /32 host LOCAL
        |-- 10.99.0.255
           /32 link BROADCAST
           /32 link BROADCAST
     +-- 127.0.0.0/8 2 0 2
        |-- 127.0.0.1
           /32 host LOCAL
Local:
  +-- 0.0.0.0/0 3 0 5
     |-- 192.0.2.2
        /32 host LOCAL
        /24 link UNICAST
     |-- 192.0.2.255
        /32 link BROADCAST
"""


def test_an_address_on_two_interfaces_is_read_once() -> None:
    # It read "LOCAL" as an address: ValueError, and every open-egress run failed with
    # "could not set up the sandbox's limits".
    assert private_network.local_addresses(TWICE) == [
        IPv4Network("10.99.0.1/32"),
        IPv4Network("127.0.0.1/32"),
        IPv4Network("192.0.2.2/32"),
    ]


def test_entries_that_are_not_the_hosts_are_left_out() -> None:
    assert private_network.local_addresses("Main:\n  +-- 0.0.0.0/0 3 0 5\n") == []
    assert private_network.local_addresses("/32 host LOCAL\n") == []  # no key above it


def test_this_hosts_addresses_are_read() -> None:
    assert IPv4Network("127.0.0.1/32") in private_network.host_addresses()


# As Linux 6.18 prints it (read off this machine, in a network namespace of its own) with
# 203.0.113.5/24 on lo, `ip route add local 198.51.100.0/24 dev lo`, `ip route add local
# 100.64.1.1 dev lo tos 8`, and `ip route add local 100.64.9.9 dev lo table 100` behind an
# `ip rule`: the host answers for every address of both /24s, 127/8 alike.
LOCAL_ROUTES = """\
Id 100:
  |-- 100.64.9.9
     /32 host LOCAL
Local:
  +-- 0.0.0.0/0 2 0 2
     +-- 96.0.0.0/3 2 0 2
        |-- 100.64.1.1
           /32 host LOCAL tos=8
        +-- 127.0.0.0/8 2 0 2
           +-- 127.0.0.0/31 1 0 0
              |-- 127.0.0.0
                 /8 host LOCAL
              |-- 127.0.0.1
                 /32 host LOCAL
           |-- 127.255.255.255
              /32 link BROADCAST
     +-- 192.0.0.0/4 2 0 2
        |-- 198.51.100.0
           /24 host LOCAL
        +-- 203.0.113.0/24 2 0 2
           +-- 203.0.113.0/29 2 0 2
              |-- 203.0.113.0
                 /24 host LOCAL
              |-- 203.0.113.5
                 /32 host LOCAL
           |-- 203.0.113.255
              /32 link BROADCAST
"""


def test_networks_a_local_route_holds_whole_are_closed_not_only_addresses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Only "/32 host LOCAL" counted: the rest of 198.51.100.0/24 and 203.0.113.0/24 (any
    # address in them reaches the host's listeners) and a route with a tos were open to
    # every open-egress sandbox.
    tool = private_network.NetworkTool("pasta", "/usr/bin/pasta")
    found = private_network.local_addresses(LOCAL_ROUTES)
    assert found == [
        IPv4Network("100.64.1.1/32"),
        IPv4Network("100.64.9.9/32"),
        IPv4Network("127.0.0.0/8"),
        IPv4Network("127.0.0.1/32"),
        IPv4Network("198.51.100.0/24"),
        IPv4Network("203.0.113.0/24"),
        IPv4Network("203.0.113.5/32"),
    ]
    monkeypatch.setattr(private_network, "host_addresses", lambda: found)
    script = private_network.rules(tool, allow=[])
    for closed in ("198.51.100.0/24", "203.0.113.0/24", "100.64.1.1/32"):
        assert f"rule add to {closed} unreachable pref 200\n" in script, script
    assert "127.0.0.1/32" not in script  # the sandbox's own loopback answers for these
    assert "127.0.0.0/8 unreachable pref 200" not in script


# As Linux 6.18 prints a transparent proxy's table (`ip rule add fwmark 1 lookup 100`, `ip
# route add local 0.0.0.0/0 dev lo table 100`): only marked packets are the host's.
TPROXY = """\
Id 100:
  +-- 0.0.0.0/0 2 0 2
     |-- 0.0.0.0
        /0 host LOCAL
     |-- 198.51.100.9
        /32 host LOCAL
Local:
  +-- 127.0.0.0/8 2 0 2
     +-- 127.0.0.0/31 1 0 0
        |-- 127.0.0.0
           /8 host LOCAL
        |-- 127.0.0.1
           /32 host LOCAL
"""


def test_a_network_in_a_table_of_its_own_does_not_close_every_destination() -> None:
    assert private_network.local_addresses(TPROXY) == [
        IPv4Network("127.0.0.0/8"),
        IPv4Network("127.0.0.1/32"),
        IPv4Network("198.51.100.9/32"),
    ]
