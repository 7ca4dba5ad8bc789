"""Which callback URLs the relay will POST to: the guard against server-side request forgery.

A ``callback_url`` is checked when the run is submitted (a refused URL is a 422
``callback_refused``) and again before every delivery attempt, because what a name
resolves to can change. The rules:

- ``https`` only, unless ``RELAY_WEBHOOK_ALLOW_HTTP``; no user:password in the URL;
- the URL's literal address, or every address its host resolves to, must be global
  unicast: loopback, private, link-local, site-local, shared (CGNAT), unspecified,
  multicast, documentation and other special-purpose addresses are refused unless
  ``RELAY_WEBHOOK_ALLOW_PRIVATE`` (for tests and internal networks). IPv4 written inside
  IPv6 is judged as that IPv4 address (``::ffff:127.0.0.1``, NAT64 ``64:ff9b::/96``,
  6to4); every other IPv6 outside ``2000::/3`` is refused (``::127.0.0.1``,
  ``::ffff:0:7f00:1``, ``fec0::1``), and so is Teredo;
- cloud metadata endpoints (``169.254.169.254`` and friends) are refused always.

A delivery connects to the very address that was checked (see :class:`CallbackTarget`),
so a name cannot pass the check and then resolve elsewhere for the connection.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

from relay.errors import CallbackRefused
from relay.settings import Settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Awaitable[list[str]]]
"""host, port → the addresses a connection could go to (as text)."""

METADATA = frozenset(
    ipaddress.ip_address(text)
    for text in (
        "169.254.169.254",  # AWS, GCP, Azure, DigitalOcean, Oracle, OpenStack
        "169.254.170.2",  # AWS ECS task credentials
        "100.100.100.200",  # Alibaba Cloud
        "fd00:ec2::254",  # AWS over IPv6
    )
)
NAT64 = ipaddress.ip_network("64:ff9b::/96")
SIXTOFOUR = ipaddress.ip_network("2002::/16")
GLOBAL_UNICAST_V6 = ipaddress.ip_network("2000::/3")
NOT_GLOBAL_V6 = tuple(
    ipaddress.ip_network(text)
    for text in (
        "2001::/23",  # IETF protocol assignments: Teredo, benchmarking, ORCHID, ...
        "2001:db8::/32",  # documentation
        "3fff::/20",  # documentation (RFC 9637)
    )
)
NOT_GLOBAL_V4 = tuple(
    ipaddress.ip_network(text)
    for text in (
        "192.0.0.0/24",  # IETF protocol assignments
        "192.88.99.0/24",  # the deprecated 6to4 relay anycast
    )
)
RESOLVE_TIMEOUT_S = 5.0


class CallbackUnresolved(Exception):
    """The host did not resolve now; a delivery retries this, a submit refuses it."""


@dataclass(frozen=True)
class CallbackTarget:
    """Where a checked callback goes: a URL naming the checked address, and the names
    that go in the ``Host`` header and the TLS handshake."""

    url: str
    host_header: str
    tls_hostname: str | None
    address: str


def _embedded_ipv4(address: IPAddress) -> IPAddress:
    """The IPv4 address a connection to ``address`` really reaches, for the forms that
    carry one: IPv4-mapped (``::ffff:a.b.c.d``), NAT64 (``64:ff9b::/96``) and 6to4."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address in NAT64:
            return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if address.sixtofour is not None:
            return address.sixtofour
    return address


def _not_global_unicast(address: IPAddress) -> bool:
    """True unless ``address`` is public unicast. IPv6 must be in 2000::/3, outside its
    special-purpose blocks: this refuses whatever hides another address (IPv4-compatible
    ``::a.b.c.d``, SIIT ``::ffff:0:a.b.c.d``, Teredo, local-use NAT64 ``64:ff9b:1::/48``)
    and the deprecated site-local ``fec0::/10``, which Python calls global."""
    if address.is_multicast or not address.is_global:
        return True
    if isinstance(address, ipaddress.IPv6Address):
        if address not in GLOBAL_UNICAST_V6:
            return True
        return any(address in network for network in NOT_GLOBAL_V6)
    return any(address in network for network in NOT_GLOBAL_V4)


def forbidden_reason(address: IPAddress, *, allow_private: bool) -> str | None:
    """Why the relay will not POST to this address, or None when it may."""
    address = _embedded_ipv4(address)
    if address in METADATA:
        return "a cloud metadata address"
    if allow_private:
        return None
    if address.is_loopback:
        return "a loopback address"
    if address.is_link_local:
        return "a link-local address"
    if address.is_unspecified:
        return "an unspecified address"
    if address.is_multicast:
        return "a multicast address"
    if address.is_private:
        return "a private address"
    if _not_global_unicast(address):
        return "a non-public address"
    return None


def parse_callback_url(url: str, *, allow_http: bool) -> SplitResult:
    """The URL's parts, or CallbackRefused for a scheme, form or host we never call."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError as exc:
        raise CallbackRefused("callback_url is not a valid URL") from exc
    schemes = ("https", "http") if allow_http else ("https",)
    if parts.scheme not in schemes:
        hint = "" if allow_http else " (RELAY_WEBHOOK_ALLOW_HTTP=true allows http)"
        raise CallbackRefused("callback_url must use " + " or ".join(schemes) + hint)
    if not parts.hostname:
        raise CallbackRefused("callback_url has no host")
    if parts.username is not None or parts.password is not None:
        raise CallbackRefused("callback_url must not carry a user or password")
    if any(ord(char) < 33 for char in url):
        raise CallbackRefused("callback_url must not contain spaces or control characters")
    return parts


async def system_resolver(host: str, port: int) -> list[str]:
    """The system's answer (``getaddrinfo``), as the connection itself would see it."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(RESOLVE_TIMEOUT_S):
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, TimeoutError, UnicodeError) as exc:
        raise CallbackUnresolved(host) from exc
    return [str(info[4][0]) for info in infos]


async def check_callback_url(
    url: str,
    *,
    allow_http: bool,
    allow_private: bool,
    resolver: Resolver = system_resolver,
) -> CallbackTarget:
    """Resolve and check ``url``; every address must pass. Returns the pinned target."""
    parts = parse_callback_url(url, allow_http=allow_http)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        literal: IPAddress | None = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None:
        texts = [str(literal)]
    else:
        texts = await resolver(host, port)
        if not texts:
            raise CallbackUnresolved(host)
    addresses = [ipaddress.ip_address(text.split("%", 1)[0]) for text in texts]
    for address in addresses:
        reason = forbidden_reason(address, allow_private=allow_private)
        if reason is not None:
            hint = "" if address in METADATA else " (RELAY_WEBHOOK_ALLOW_PRIVATE=true allows it)"
            raise CallbackRefused(f"callback_url resolves to {reason}{hint}")
    chosen = addresses[0]
    shown = f"[{chosen}]" if chosen.version == 6 else str(chosen)
    netloc = f"{shown}:{port}"
    target = parts._replace(netloc=netloc, fragment="").geturl()
    host_header = parts.netloc.rsplit("@", 1)[-1]
    tls_hostname = host if parts.scheme == "https" and literal is None else None
    return CallbackTarget(target, host_header, tls_hostname, str(chosen))


async def refuse_unsafe_callback(
    url: str, settings: Settings, resolver: Resolver = system_resolver
) -> None:
    """The check at submit: CallbackRefused (422) unless ``url`` may be called now."""
    try:
        await check_callback_url(
            url,
            allow_http=settings.webhook_allow_http,
            allow_private=settings.webhook_allow_private,
            resolver=resolver,
        )
    except CallbackUnresolved as exc:
        raise CallbackRefused("callback_url's host does not resolve") from exc
