"""Signed webhooks end to end: a real relay process POSTs finished runs to a receiver on
loopback, retries with backoff, survives a restart, and refuses unsafe URLs at submit."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from relay.client import verify_signature
from relay.store.database import Store
from relay.webhooks.dispatcher import sign
from testing.relay_server import RelayProcess, free_port
from testing.rows import run_row
from tests.receiver import Received, Receiver

pytestmark = pytest.mark.slow  # needs a relay process: seconds

TOKEN_SECRET = "whsec-token-5b1e"
STANDARD_SECRET = "whsec_" + base64.b64encode(b"standard-key-3e8a-0123456789abcd").decode()
GLOBAL_SECRET = "whsec-global-9c2d"
ECHO = {"job": "echo", "params": {"message": "hi"}}


def give_webhook_secret(relay: RelayProcess, name: str, secret: str) -> None:
    """Add ``webhook_secret`` to a token's table in the token file."""
    text = relay.tokens_file.read_text()
    header = f"[tokens.{name}]\n"
    relay.tokens_file.write_text(text.replace(header, f'{header}webhook_secret = "{secret}"\n'))


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    server = RelayProcess(
        tmp_path_factory.mktemp("webhooks"),
        local_isolation="bwrap",
        webhook_allow_http="true",
        webhook_allow_private="true",
        webhook_backoff_s=0.2,
        webhook_max_attempts=4,
        webhook_secret=GLOBAL_SECRET,
    )
    server.add_token("hooks")
    give_webhook_secret(server, "hooks", TOKEN_SECRET)
    server.add_token("plain")
    server.add_token("standard")
    give_webhook_secret(server, "standard", STANDARD_SECRET)
    server.start()
    yield server
    server.stop()
    log = server.log()
    assert TOKEN_SECRET not in log and GLOBAL_SECRET not in log


def submit(relay: RelayProcess, token: str, url: str, **extra: Any) -> dict[str, Any]:
    answer = relay.post(relay.tokens[token], {**ECHO, "callback_url": url, **extra})
    assert answer.status_code in (200, 202), answer.text
    run: dict[str, Any] = answer.json()
    return run


def wait_delivery(
    relay: RelayProcess, token: str, run_id: str, state: str, attempts: int | None = None
) -> dict[str, Any]:
    """The run once its delivery reads ``state`` (and has ``attempts`` attempts)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        run: dict[str, Any] = relay.get(relay.tokens[token], f"/v1/runs/{run_id}").json()
        found = run["deliveries"]
        if (
            found
            and found[0]["state"] == state
            and (attempts is None or len(found[0]["attempts"]) == attempts)
        ):
            return run
        time.sleep(0.05)
    raise AssertionError(f"delivery of {run_id} never became {state}: {run}")


def check_signed(received: Received, secret: str) -> dict[str, Any]:
    assert verify_signature(secret, received.headers["Relay-Signature"], received.body, 60)
    body: dict[str, Any] = json.loads(received.body)
    return body


def test_each_run_is_delivered_once_signed_with_its_secret(relay: RelayProcess) -> None:
    with Receiver() as receiver:
        own = [submit(relay, "hooks", receiver.url) for _ in range(3)]
        shared = submit(relay, "plain", receiver.url)
        for run, secret in [*((run, TOKEN_SECRET) for run in own), (shared, GLOBAL_SECRET)]:
            (received,) = receiver.wait_for(run["id"])
            token = "plain" if run is shared else "hooks"
            final = wait_delivery(relay, token, run["id"], "delivered", attempts=1)
            body = check_signed(received, secret)
            other = GLOBAL_SECRET if secret == TOKEN_SECRET else TOKEN_SECRET
            assert not verify_signature(other, received.headers["Relay-Signature"], received.body)
            # The body is the run as GET shows it (deliveries as they stood when sent).
            assert {k: v for k, v in body.items() if k != "deliveries"} == {
                k: v for k, v in final.items() if k != "deliveries"
            }
            assert body["state"] == "succeeded" and body["stdout"] == "hi\n"
            delivery = final["deliveries"][0]
            assert received.headers["Relay-Run-Id"] == run["id"]
            assert received.headers["Relay-Delivery-Id"] == delivery["id"]
            assert received.headers["Content-Type"] == "application/json"
            assert received.path == "/hook"
            assert delivery["attempts"][0]["status_code"] == 200
        time.sleep(0.3)  # longer than a retry would wait: nothing more arrives
        for run in [*own, shared]:
            assert len(receiver.for_run(run["id"])) == 1


def test_standard_webhooks_signature_is_sent_alongside(relay: RelayProcess) -> None:
    """A receiver's Standard Webhooks library verifies each delivery: a ``whsec_`` secret
    as the spec has it (base64 of the key), a plain one as its bytes; ``verify_signature``
    checks either scheme from the headers."""
    with Receiver() as receiver:
        plain, standard = (
            submit(relay, "hooks", receiver.url),
            submit(relay, "standard", receiver.url),
        )
        (by_plain,) = receiver.wait_for(plain["id"])
        (by_standard,) = receiver.wait_for(standard["id"])
    for received, secret, library in [
        (by_plain, TOKEN_SECRET, Webhook(TOKEN_SECRET.encode())),
        (by_standard, STANDARD_SECRET, Webhook(STANDARD_SECRET)),
    ]:
        headers, body = received.headers, received.body
        assert library.verify(body, headers)["id"] == received.headers["Relay-Run-Id"]
        assert headers["webhook-id"] == headers["Relay-Delivery-Id"]
        assert headers["Relay-Signature"].startswith(f"t={headers['webhook-timestamp']},")
        with pytest.raises(WebhookVerificationError):
            library.verify(body + b" ", headers)
        assert verify_signature(secret, headers, body, 60)  # webhook-signature
        assert verify_signature(secret, headers["Relay-Signature"], body, 60)
        only_relay = {k: v for k, v in headers.items() if not k.startswith("webhook-")}
        assert verify_signature(secret, only_relay, body, 60)
        assert not verify_signature(secret, headers, body + b" ", 60)
        assert not verify_signature("whsec-other-secret", headers, body, 60)
        assert not verify_signature(secret, {**headers, "webhook-id": "dlv_other"}, body, 60)
        assert not verify_signature(secret, headers, body, 60, now=time.time() + 120)
    # The plain secret's Standard key is its bytes: the whsec_ spelling of it verifies too.
    as_whsec = "whsec_" + base64.b64encode(TOKEN_SECRET.encode()).decode()
    assert Webhook(as_whsec).verify(by_plain.body, by_plain.headers)
    assert verify_signature(as_whsec, by_plain.headers, by_plain.body, 60)


def test_a_receiver_failing_twice_gets_three_attempts(relay: RelayProcess) -> None:
    with Receiver([500, 503, 204]) as receiver:
        run = submit(relay, "hooks", receiver.url)
        received = receiver.wait_for(run["id"], 3)
        final = wait_delivery(relay, "hooks", run["id"], "delivered", attempts=3)
    delivery = final["deliveries"][0]
    assert [a["status_code"] for a in delivery["attempts"]] == [500, 503, 204]
    assert [a["attempt"] for a in delivery["attempts"]] == [1, 2, 3]
    assert [r.headers["Relay-Delivery-Attempt"] for r in received] == ["1", "2", "3"]
    assert {r.headers["Relay-Delivery-Id"] for r in received} == {delivery["id"]}
    for one in received:
        check_signed(one, TOKEN_SECRET)
    # Exponential backoff with jitter: 0.1-0.2 s, then 0.2-0.4 s (RELAY_WEBHOOK_BACKOFF_S=0.2).
    first_gap = received[1].at - received[0].at
    second_gap = received[2].at - received[1].at
    assert 0.09 <= first_gap < 1.0 and 0.19 <= second_gap < 1.5, (first_gap, second_gap)


def test_delivery_gives_up_after_max_attempts(relay: RelayProcess) -> None:
    with Receiver([500]) as receiver:
        run = submit(relay, "hooks", receiver.url)
        final = wait_delivery(relay, "hooks", run["id"], "failed")
        time.sleep(0.3)
        assert len(receiver.for_run(run["id"])) == 4  # RELAY_WEBHOOK_MAX_ATTEMPTS
    assert [a["status_code"] for a in final["deliveries"][0]["attempts"]] == [500] * 4
    assert final["deliveries"][0]["next_attempt_at"] is None


def test_connection_errors_are_retried_and_recorded(relay: RelayProcess) -> None:
    nobody = f"http://127.0.0.1:{free_port()}/hook"
    run = submit(relay, "hooks", nobody)
    final = wait_delivery(relay, "hooks", run["id"], "failed", attempts=4)
    for attempt in final["deliveries"][0]["attempts"]:
        assert attempt["status_code"] is None and attempt["error"].startswith("connection")


def test_async_submit_and_list_show_deliveries(relay: RelayProcess) -> None:
    with Receiver() as receiver:
        run = submit(relay, "hooks", receiver.url, wait=False)
        receiver.wait_for(run["id"])
        wait_delivery(relay, "hooks", run["id"], "delivered")
    listed = relay.get(relay.tokens["hooks"], "/v1/runs", limit=50).json()["runs"]
    mine = next(item for item in listed if item["id"] == run["id"])
    assert mine["deliveries"][0]["state"] == "delivered"
    plain = relay.post(relay.tokens["hooks"], ECHO).json()
    assert plain["deliveries"] == []


def test_tampered_body_or_old_timestamp_fails_verification(relay: RelayProcess) -> None:
    with Receiver() as receiver:
        run = submit(relay, "hooks", receiver.url)
        (received,) = receiver.wait_for(run["id"])
    header, body = received.headers["Relay-Signature"], received.body
    stamp = int(header.split(",")[0].removeprefix("t="))
    assert verify_signature(TOKEN_SECRET, header, body, tolerance_s=300)
    assert not verify_signature(TOKEN_SECRET, header, body.replace(b"hi", b"ho"), 300)
    assert not verify_signature(TOKEN_SECRET, header, body + b" ", 300)
    assert not verify_signature(TOKEN_SECRET, header, body, 300, now=stamp + 301)
    old = sign(TOKEN_SECRET, body, timestamp=int(time.time()) - 600)
    assert not verify_signature(TOKEN_SECRET, old, body, tolerance_s=300)
    assert verify_signature(TOKEN_SECRET, old, body, tolerance_s=900)
    replayed = header.replace(f"t={stamp}", f"t={stamp + 1}")
    assert not verify_signature(TOKEN_SECRET, replayed, body, 300)
    for broken in ("", "v1=abc", f"t={stamp}", "t=x,v1=y", None):
        assert not verify_signature(TOKEN_SECRET, broken, body, 300)


def test_a_relay_restarted_mid_backoff_still_delivers(tmp_path: Path) -> None:
    server = RelayProcess(
        tmp_path / "restart",
        local_isolation="bwrap",
        webhook_allow_http="true",
        webhook_allow_private="true",
        webhook_backoff_s=3,
        webhook_max_attempts=3,
    )
    server.add_token("hooks")
    give_webhook_secret(server, "hooks", TOKEN_SECRET)
    with Receiver([500, 200]) as receiver:
        server.start()
        try:
            run = submit(server, "hooks", receiver.url)
            receiver.wait_for(run["id"], 1)
            waiting = wait_delivery(server, "hooks", run["id"], "pending", attempts=1)
            server.kill()  # SIGKILL while the retry is 1.5-3 s away
            assert len(receiver.for_run(run["id"])) == 1
            server.start()
            received = receiver.wait_for(run["id"], 2)
            final = wait_delivery(server, "hooks", run["id"], "delivered", attempts=2)
        finally:
            server.stop()
    assert [a["status_code"] for a in final["deliveries"][0]["attempts"]] == [500, 200]
    assert final["deliveries"][0]["id"] == waiting["deliveries"][0]["id"]
    check_signed(received[1], TOKEN_SECRET)
    assert received[1].headers["Relay-Delivery-Id"] == received[0].headers["Relay-Delivery-Id"]


def test_a_run_the_reaper_marks_lost_is_delivered_at_once(tmp_path: Path) -> None:
    """The reaper's sweep wakes the dispatcher: no wait for RELAY_WEBHOOK_POLL_S."""
    server = RelayProcess(
        tmp_path / "reaped",
        local_isolation="bwrap",
        reap_interval_s=1,
        webhook_poll_s=60,
        webhook_allow_http="true",
        webhook_allow_private="true",
    )
    server.add_token("hooks")
    give_webhook_secret(server, "hooks", TOKEN_SECRET)

    async def orphan(url: str) -> None:
        """A running run owned by a relay that died, as its row was left."""
        store = await Store.open(server.env["RELAY_DATABASE_URL"])
        now = time.time()
        try:
            await store.admit_run(
                run_row("run_orphaned", token="hooks", timeout_s=60.0, started_at=now,
                        deadline=now + 60, owner="a-relay-that-died", callback_url=url)
            )  # fmt: skip
        finally:
            await store.close()

    with Receiver() as receiver:
        server.start()
        try:
            time.sleep(0.5)  # the dispatcher has looked once and now waits out its poll
            asyncio.run(orphan(receiver.url))
            seeded = time.time()
            (received,) = receiver.wait_for("run_orphaned", timeout_s=10)
            final = wait_delivery(server, "hooks", "run_orphaned", "delivered", attempts=1)
        finally:
            server.stop()
    assert received.at - seeded < 5, "delivered at the next poll, not when the run was reaped"
    body = check_signed(received, TOKEN_SECRET)
    assert body["state"] == "lost" and body["error"]["code"] == "sandbox_lost"
    assert final["state"] == "lost"
