"""SSRF table: every forbidden address family is refused at submit (a real relay answers
422 and makes no run) and again at delivery (a real dispatcher, store and receiver: the
receiver hears nothing), including names that resolve to loopback."""

from __future__ import annotations

import ipaddress
import ssl
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme

from relay.errors import CallbackRefused
from relay.runs.callback_urls import check_callback_url, refuse_unsafe_callback
from relay.store.database import Store
from relay.store.deliveries import Deliveries
from relay.webhooks.dispatcher import WebhookDispatcher
from testing.relay_server import RelayProcess
from testing.rows import run_row
from tests.conftest import make_settings
from tests.receiver import Receiver

ECHO = {"job": "echo", "params": {"message": "x"}, "wait": False}
PUBLIC = "93.184.216.34"

# (name, address a host resolves to); each must be refused.
FORBIDDEN = [
    ("loopback", "127.0.0.1"),
    ("loopback elsewhere in 127/8", "127.9.8.7"),
    ("loopback v6", "::1"),
    ("private 10/8", "10.1.2.3"),
    ("private 172.16/12", "172.16.5.4"),
    ("private 192.168/16", "192.168.0.10"),
    ("private v6 (ULA)", "fd00::1"),
    ("link-local", "169.254.10.10"),
    ("link-local v6", "fe80::1"),
    ("cloud metadata", "169.254.169.254"),
    ("cloud metadata v6", "fd00:ec2::254"),
    ("cloud metadata (Alibaba)", "100.100.100.200"),
    ("shared CGNAT", "100.64.0.1"),
    ("unspecified", "0.0.0.0"),
    ("unspecified v6", "::"),
    ("multicast", "224.0.0.1"),
    ("IPv4-mapped loopback", "::ffff:127.0.0.1"),
    ("NAT64 private", "64:ff9b::a00:1"),
    ("6to4 loopback", "2002:7f00:1::1"),
    ("documentation", "192.0.2.1"),
    ("IPv4-compatible loopback", "::127.0.0.1"),
    ("IPv4-compatible private", "::10.0.0.1"),
    ("SIIT loopback (::ffff:0:0/96)", "::ffff:0:7f00:1"),
    ("site-local v6 (deprecated)", "fec0::1"),
    ("local-use NAT64", "64:ff9b:1::a00:1"),
    ("6to4 private", "2002:a00:1::1"),
    ("Teredo", "2001:0:4136:e378:8000:63bf:3fff:fdd2"),
    ("documentation v6", "2001:db8::1"),
    ("documentation v6 (3fff::/20)", "3fff::1"),
    ("outside 2000::/3", "4000::1"),
    ("6to4 relay anycast", "192.88.99.1"),
    ("IPv4-mapped private", "::ffff:192.168.1.1"),
]
PUBLIC_FORMS = [
    "93.184.216.34",
    "2606:2800:220:1::1",
    "::ffff:93.184.216.34",  # IPv4-mapped public
    "64:ff9b::5db8:d822",  # NAT64 of a public address (what DNS64 answers)
    "2002:5db8:d822::1",  # 6to4 of a public address
]


def literal(address: str) -> str:
    return f"[{address}]" if ":" in address else address


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    """Default policy: https only, public addresses only; no global secret."""
    server = RelayProcess(tmp_path_factory.mktemp("ssrf"), local_isolation="bwrap")
    server.add_token("hooks")
    text = server.tokens_file.read_text()
    server.tokens_file.write_text(
        text.replace("[tokens.hooks]\n", '[tokens.hooks]\nwebhook_secret = "s3"\n')
    )
    server.add_token("unsigned")
    server.start()
    yield server
    server.stop()


def refused_at_submit(relay: RelayProcess, url: str, who: str = "hooks") -> str:
    token = relay.tokens[who]
    before = len(relay.get(token, "/v1/runs", limit=200).json()["runs"])
    answer = relay.post(token, {**ECHO, "callback_url": url})
    assert answer.status_code == 422, (url, answer.text)
    error = answer.json()["error"]
    assert error["code"] == "callback_refused"
    after = len(relay.get(token, "/v1/runs", limit=200).json()["runs"])
    assert after == before, "a refused callback must not create a run"
    message: str = error["message"]
    return message


@pytest.mark.slow  # needs a relay process: seconds
@pytest.mark.parametrize(("name", "address"), FORBIDDEN, ids=[f[0] for f in FORBIDDEN])
def test_forbidden_address_is_refused_at_submit(
    relay: RelayProcess, name: str, address: str
) -> None:
    message = refused_at_submit(relay, f"https://{literal(address)}/hook")
    assert "resolves to" in message


@pytest.mark.slow  # needs a relay process: seconds
@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("https://localhost/hook", "loopback"),  # a name resolving to 127.0.0.1
        ("https://2130706433/hook", "loopback"),  # 127.0.0.1 as one decimal number
        ("https://0x7f.1/hook", "loopback"),  # and in hex shorthand
        ("http://example.com/hook", "https"),
        ("ftp://example.com/hook", "https"),
        ("https://user:pw@example.com/hook", "user or password"),
        ("https://no-such-host.invalid/hook", "does not resolve"),
        ("https:///hook", "no host"),
        ("https://example.com:99999/hook", "not a valid URL"),
    ],
)
def test_unsafe_url_is_refused_at_submit(relay: RelayProcess, url: str, why: str) -> None:
    assert why in refused_at_submit(relay, url)


@pytest.mark.slow  # needs a relay process: seconds
def test_a_token_without_a_secret_cannot_ask_for_callbacks(relay: RelayProcess) -> None:
    message = refused_at_submit(relay, f"https://{PUBLIC}/hook", who="unsigned")
    assert "secret" in message


@pytest.mark.parametrize("address", PUBLIC_FORMS)
async def test_public_addresses_pass_the_check(address: str) -> None:
    """The control for the table: global unicast, in every form that carries it, passes."""
    target = await check_callback_url(
        f"https://{literal(address)}/hook", allow_http=False, allow_private=False
    )
    assert ipaddress.ip_address(target.address) == ipaddress.ip_address(address)


@pytest.mark.slow  # needs a relay process: seconds
def test_a_public_https_url_is_accepted(relay: RelayProcess) -> None:
    answer = relay.post(relay.tokens["hooks"], {**ECHO, "callback_url": f"https://{PUBLIC}/h"})
    assert answer.status_code == 202, answer.text


# --- at delivery: the same rules, checked again just before each attempt ----------------


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    opened = await Store.open(f"sqlite:///{tmp_path / 'relay.db'}")
    yield opened
    await opened.close()


async def finished_run(store: Store, run_id: str, url: str) -> None:
    await store.admit_run(run_row(run_id, token="hooks", callback_url=url))
    await store.update_run(run_id, state="succeeded", exit_code=0, ended_at=time.time())


def resolving_to(address: str) -> Any:
    async def resolver(host: str, port: int) -> list[str]:
        return [address]

    return resolver


async def deliver(
    tmp_path: Path, store: Store, *, allow_private: bool, resolver: Any = None
) -> WebhookDispatcher:
    settings = make_settings(
        tmp_path,
        webhook_allow_http=True,
        webhook_allow_private=allow_private,
        webhook_secret="global",
    )
    extra = {"resolver": resolver} if resolver else {}
    dispatcher = WebhookDispatcher(settings, store, secret_for=lambda name: None, **extra)
    await dispatcher.dispatch_due()
    await dispatcher.drain()
    await dispatcher.aclose()
    return dispatcher


@pytest.mark.parametrize(("name", "address"), FORBIDDEN, ids=[f[0] for f in FORBIDDEN])
async def test_forbidden_address_is_refused_at_delivery(
    tmp_path: Path, store: Store, name: str, address: str
) -> None:
    """The name passed at submit (say it was public then) but resolves here now."""
    with Receiver() as receiver:
        url = f"http://hooks.example.com:{receiver.port}/hook"
        await finished_run(store, "run_1", url)
        await deliver(tmp_path, store, allow_private=False, resolver=resolving_to(address))
        assert receiver.received == []
    (delivery,) = (await Deliveries(store).for_runs(["run_1"]))["run_1"]
    assert delivery.state == "failed" and delivery.attempts == 1
    assert '"error": "refused: callback_url resolves to' in delivery.attempt_log


async def test_localhost_is_refused_at_delivery(tmp_path: Path, store: Store) -> None:
    with Receiver() as receiver:
        await finished_run(store, "run_1", f"http://localhost:{receiver.port}/hook")
        await deliver(tmp_path, store, allow_private=False)  # the system's resolver
        assert receiver.received == []
    (delivery,) = (await Deliveries(store).for_runs(["run_1"]))["run_1"]
    assert delivery.state == "failed" and "loopback" in delivery.attempt_log


async def test_the_same_delivery_goes_through_when_private_is_allowed(
    tmp_path: Path, store: Store
) -> None:
    """The control for the two tests above: only the policy stopped them."""
    with Receiver() as receiver:
        await finished_run(store, "run_1", f"http://localhost:{receiver.port}/hook")
        await deliver(tmp_path, store, allow_private=True)
        (received,) = receiver.received
    assert received.headers["Host"] == f"localhost:{receiver.port}"
    (delivery,) = (await Deliveries(store).for_runs(["run_1"]))["run_1"]
    assert delivery.state == "delivered"


async def test_a_name_that_turns_private_after_submit_is_refused(
    tmp_path: Path, store: Store
) -> None:
    answers = iter([[PUBLIC], ["127.0.0.1"]])

    async def rebinding(host: str, port: int) -> list[str]:
        return next(answers)

    settings = make_settings(tmp_path, webhook_allow_http=True)
    with Receiver() as receiver:
        url = f"http://rebind.example.com:{receiver.port}/hook"
        await refuse_unsafe_callback(url, settings, resolver=rebinding)  # passes at submit
        await finished_run(store, "run_1", url)
        await deliver(tmp_path, store, allow_private=False, resolver=rebinding)
        assert receiver.received == []


async def test_any_forbidden_address_among_several_refuses() -> None:
    with pytest.raises(CallbackRefused, match="loopback"):
        await check_callback_url(
            "https://hooks.example.com/",
            allow_http=False,
            allow_private=False,
            resolver=lambda host, port: _answer([PUBLIC, "127.0.0.1"]),
        )


async def _answer(addresses: list[str]) -> list[str]:
    return addresses


async def test_the_connection_goes_to_the_checked_address() -> None:
    target = await check_callback_url(
        "https://hooks.example.com:8443/path?q=1#frag",
        allow_http=False,
        allow_private=False,
        resolver=lambda host, port: _answer(["2606:2800:220:1::1"]),
    )
    assert target.url == "https://[2606:2800:220:1::1]:8443/path?q=1"
    assert target.host_header == "hooks.example.com:8443"
    assert target.tls_hostname == "hooks.example.com"


class TlsReceiver(Receiver):
    """The loopback receiver behind TLS, with a certificate for ``name`` from ``ca``."""

    def __init__(self, ca: trustme.CA, name: str) -> None:
        super().__init__()
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ca.issue_cert(name).configure_cert(context)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)


@pytest.mark.parametrize(("certified", "delivered"), [("hooks.test", True), ("other.test", False)])
async def test_https_to_the_pinned_address_still_checks_the_urls_name(
    tmp_path: Path, store: Store, certified: str, delivered: bool
) -> None:
    """Connecting to the checked IP must not weaken TLS: the certificate must name the
    URL's host (a certificate for another name fails the attempt)."""
    ca = trustme.CA()
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    settings = make_settings(tmp_path, webhook_allow_private=True, webhook_secret="global")
    with TlsReceiver(ca, certified) as receiver:
        await finished_run(store, "run_1", f"https://hooks.test:{receiver.port}/hook")
        dispatcher = WebhookDispatcher(
            settings,
            store,
            secret_for=lambda name: None,
            resolver=resolving_to("127.0.0.1"),
            verify=client_context,
        )
        await dispatcher.dispatch_due()
        await dispatcher.drain()
        await dispatcher.aclose()
        assert len(receiver.received) == (1 if delivered else 0)
    (delivery,) = (await Deliveries(store).for_runs(["run_1"]))["run_1"]
    if delivered:
        assert delivery.state == "delivered"
        assert receiver.received[0].headers["Host"] == f"hooks.test:{receiver.port}"
    else:
        assert delivery.state == "pending" and '"error": "connection' in delivery.attempt_log
