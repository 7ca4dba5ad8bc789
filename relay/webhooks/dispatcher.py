"""Signed webhooks: when a run with a ``callback_url`` ends, POST it there, until it lands.

The delivery row is written with the run's final state (``delivery_for_final_run`` in
relay/store/database.py); this module sends it. The body is exactly what
``GET /v1/runs/{id}`` answers at that moment. Headers::

    webhook-id: dlv_…               (Standard Webhooks: the delivery id)
    webhook-timestamp: <unix seconds>
    webhook-signature: v1,<base64 HMAC-SHA256 of "<id>.<timestamp>.<body>">
    Relay-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>">
    Relay-Run-Id: run_…
    Relay-Delivery-Id: dlv_…        (the same on every attempt: receivers dedupe on it)
    Relay-Delivery-Attempt: 1

The secret is the token's ``webhook_secret`` (token file), else ``RELAY_WEBHOOK_SECRET``.
``Relay-Signature`` keys the HMAC with its UTF-8 bytes; ``webhook-signature`` does so too,
except for a ``whsec_`` secret, whose base64 is decoded as the Standard Webhooks spec says
(relay/client.py: ``standard_webhooks_key``).
A non-2xx answer (redirects included), a timeout or a connection error is retried after
``RELAY_WEBHOOK_BACKOFF_S * 2**(attempt-1)``, with jitter, up to
``RELAY_WEBHOOK_MAX_ATTEMPTS``; a URL refused at delivery (see callback_urls.py) is not.
Each replica runs one :class:`WebhookDispatcher`; a delivery is claimed by a conditional
UPDATE with a lease, so replicas never send the same attempt twice, and pending
deliveries survive a restart because they live in the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import random
import secrets
import ssl
import time
from collections.abc import Callable
from typing import Any

import httpx

from relay import __version__
from relay.client import standard_webhooks_signature
from relay.errors import CallbackRefused
from relay.runs.callback_urls import (
    CallbackUnresolved,
    Resolver,
    check_callback_url,
    system_resolver,
)
from relay.runs.event_bus import EventBus, RunEvent
from relay.runs.view import run_model
from relay.settings import Settings
from relay.store.database import Store
from relay.store.deliveries import Deliveries
from relay.store.records import DeliveryRecord

log = logging.getLogger("relay.webhooks")

MAX_BACKOFF_S = 3600.0
CONCURRENCY = 8
SecretLookup = Callable[[str], str | None]
"""token name → that token's own webhook secret, if it has one."""


def sign(secret: str, body: bytes, timestamp: int | None = None) -> str:
    """The ``Relay-Signature`` header value for ``body``."""
    stamp = int(time.time()) if timestamp is None else timestamp
    digest = hmac.new(secret.encode(), f"{stamp}.".encode() + body, hashlib.sha256)
    return f"t={stamp},v1={digest.hexdigest()}"


def signature_headers(secret: str, delivery_id: str, body: bytes) -> dict[str, str]:
    """Both signatures of ``body``, made at one moment: the Standard Webhooks headers, whose
    receivers' libraries verify them, and ``Relay-Signature``."""
    stamp = int(time.time())
    return {
        "webhook-id": delivery_id,
        "webhook-timestamp": str(stamp),
        "webhook-signature": standard_webhooks_signature(secret, delivery_id, stamp, body),
        "Relay-Signature": sign(secret, body, stamp),
    }


def backoff_s(attempt: int, base_s: float) -> float:
    """Delay after failed attempt number ``attempt`` (1-based): half fixed, half jitter."""
    delay = min(MAX_BACKOFF_S, base_s * 2.0 ** (attempt - 1))
    return delay / 2 + random.uniform(0, delay / 2)


class WebhookDispatcher:
    """Sends due deliveries; woken by finished runs, otherwise polls the store."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        *,
        secret_for: SecretLookup,
        events: EventBus | None = None,
        resolver: Resolver = system_resolver,
        owner: str | None = None,
        verify: ssl.SSLContext | bool = True,
        on_attempt: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        self.on_attempt = on_attempt
        # told each attempt's outcome: delivered, retrying or failed (for metrics)
        self.store = store
        self.deliveries = Deliveries(store)
        self.secret_for = secret_for
        self.resolver = resolver
        self.owner = owner or "wh_" + secrets.token_hex(8)
        self.lease_s = settings.webhook_timeout_s + RESOLVE_AND_SLACK_S
        self._wake = asyncio.Event()
        self._sending: set[asyncio.Task[None]] = set()
        self._client = httpx.AsyncClient(
            timeout=settings.webhook_timeout_s,
            verify=verify,
            follow_redirects=False,
            trust_env=False,
            # One connection per attempt: a pooled TLS connection to one address could
            # otherwise be reused for another host name on the same address.
            limits=httpx.Limits(max_keepalive_connections=0),
            headers={"User-Agent": f"relay-webhooks/{__version__}"},
        )
        self._unsubscribe = events.subscribe(self._on_event, ("finished",)) if events else None

    def _on_event(self, event: RunEvent) -> None:
        # Only a run with a callback has a delivery to send; the rest cost nothing here.
        if event.kind == "finished" and event.run is not None and event.run.callback_url:
            self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    async def run_forever(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self.dispatch_due()
                next_at = await self.deliveries.next_due_at()
            except Exception as exc:
                log.error("webhook dispatch failed", extra={"error_class": type(exc).__name__})
                next_at = None
            sleep = self.settings.webhook_poll_s
            if next_at is not None:
                sleep = min(sleep, max(0.0, next_at - time.time()) + 0.01)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), sleep)

    async def dispatch_due(self) -> int:
        """Claim what is due and start sending it; returns how many were claimed.

        Only as many as can be sent at once are claimed, so no claim waits here while
        its lease runs out (another replica could then send the same attempt).
        """
        free = CONCURRENCY - len(self._sending)
        if free <= 0:
            return 0
        claimed = 0
        now = time.time()
        for delivery_id in await self.deliveries.due(now, free):
            row = await self.deliveries.claim(delivery_id, self.owner, now, self.lease_s)
            if row is None:
                continue  # another replica has it
            claimed += 1
            task = asyncio.create_task(self._send(row), name=delivery_id)
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)
        return claimed

    async def drain(self) -> None:
        """Wait for the attempts in flight (tests, and one-shot use)."""
        while self._sending:
            await asyncio.wait(set(self._sending))

    async def aclose(self) -> None:
        """Stop: attempts in flight are cut short and handed back for a later try."""
        if self._unsubscribe is not None:
            self._unsubscribe()
        for task in list(self._sending):
            task.cancel()
        if self._sending:
            await asyncio.wait(set(self._sending), timeout=5)
        await self._client.aclose()

    async def _send(self, delivery: DeliveryRecord) -> None:
        started = time.time()
        try:
            outcome = await self._attempt(delivery)
        except asyncio.CancelledError:
            outcome = {"error": "interrupted: the relay stopped"}
            attempt = {"at": started, "duration_ms": None, **outcome}
            # Give the claim back now rather than at the end of its lease.
            await asyncio.shield(self._record(delivery, attempt, retry_now=True))
            raise
        except Exception as exc:
            log.error(
                "webhook attempt failed inside the relay",
                extra={"delivery_id": delivery.id, "error_class": type(exc).__name__},
            )
            outcome = {"error": "internal: the relay failed to send"}
        attempt = {"at": started, "duration_ms": int((time.time() - started) * 1000)}
        await self._record(delivery, attempt | outcome)
        self._wake.set()  # a slot is free and the next due time changed: look again

    async def _attempt(self, delivery: DeliveryRecord) -> dict[str, Any]:
        """One POST; returns ``status_code`` and/or ``error`` (never the receiver's body)."""
        try:
            target = await check_callback_url(
                delivery.url,
                allow_http=self.settings.webhook_allow_http,
                allow_private=self.settings.webhook_allow_private,
                resolver=self.resolver,
            )
        except CallbackRefused as exc:
            return {"error": f"refused: {exc.message}", "final": True}
        except CallbackUnresolved:
            return {"error": "dns: the host did not resolve"}
        secret = self.secret_for(delivery.token)
        if secret is None and self.settings.webhook_secret is not None:
            secret = self.settings.webhook_secret.get_secret_value()
        if not secret:
            return {"error": "refused: no webhook secret for this token", "final": True}
        run = await self.store.get_run(delivery.run_id)
        if run is None:
            return {"error": "refused: the run is gone", "final": True}
        found = await self.deliveries.for_runs([run.id])
        body = run_model(run, found.get(run.id, [])).model_dump_json().encode()
        headers = {
            "Content-Type": "application/json",
            "Host": target.host_header,
            **signature_headers(secret, delivery.id, body),
            "Relay-Run-Id": run.id,
            "Relay-Delivery-Id": delivery.id,
            "Relay-Delivery-Attempt": str(delivery.attempts),
        }
        extensions = {"sni_hostname": target.tls_hostname} if target.tls_hostname else {}
        request = self._client.build_request(
            "POST", target.url, content=body, headers=headers, extensions=extensions
        )
        try:
            # The whole attempt, not each read: a receiver sending its headers a byte at a
            # time never tripped httpx's read timeout. Only the status is read: the body is
            # the receiver's (one that never ended held the attempt, and grew the relay).
            async with asyncio.timeout(self.settings.webhook_timeout_s):
                answer = await self._client.send(request, stream=True)
                await answer.aclose()
        except (httpx.TimeoutException, TimeoutError):
            return {"error": "timeout"}
        except httpx.HTTPError as exc:
            return {"error": f"connection: {type(exc).__name__}"}
        return {"status_code": answer.status_code}

    async def _record(
        self, delivery: DeliveryRecord, attempt: dict[str, Any], *, retry_now: bool = False
    ) -> None:
        final = bool(attempt.pop("final", False))
        status = attempt.get("status_code")
        number = delivery.attempts
        now = time.time()
        if status is not None and 200 <= status < 300:
            state, next_at = "delivered", now
        elif final or (number >= self.settings.webhook_max_attempts and not retry_now):
            state, next_at = "failed", now
        else:
            state = "pending"
            next_at = now if retry_now else now + backoff_s(number, self.settings.webhook_backoff_s)
        attempt = {"attempt": number, **attempt}
        await self.deliveries.record(
            delivery.id, self.owner, attempt, state=state, next_attempt_at=next_at
        )
        if self.on_attempt is not None:
            self.on_attempt("retrying" if state == "pending" else state)
        log.info(
            "webhook attempt",
            extra={
                "run_id": delivery.run_id,
                "delivery_id": delivery.id,
                "attempt": number,
                "status": status,
                "error_code": attempt.get("error"),
                "state": state,
            },
        )


RESOLVE_AND_SLACK_S = 15.0
"""Added to the HTTP timeout for a claim's lease: resolving, reading the run, signing."""
