"""The host's own addresses, read off ``/proc/net/fib_trie``: the sandbox's private network
closes each of them, so a misread one fails every open-egress run on that host."""

from __future__ import annotations

from ipaddress import IPv4Address

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
        IPv4Address("10.99.0.1"),
        IPv4Address("127.0.0.1"),
        IPv4Address("192.0.2.2"),
    ]


def test_entries_that_are_not_the_hosts_are_left_out() -> None:
    assert private_network.local_addresses("Main:\n  +-- 0.0.0.0/0 3 0 5\n") == []
    assert private_network.local_addresses("/32 host LOCAL\n") == []  # no key above it


def test_this_hosts_addresses_are_read() -> None:
    assert IPv4Address("127.0.0.1") in private_network.host_addresses()
