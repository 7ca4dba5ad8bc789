"""Routing and failover through a real relay process over two providers' fakes (E2B, then
Vercel): a create that hangs moves the run on, a waiting caller still gets its 202 at
``RELAY_MAX_WAIT_S``, ``relay exec`` says why on stderr, the breaker opens and shows on
``/v1/health`` and ``/metrics``, and a route filtered to nothing is a 422 naming each
provider's reason."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from testing.relay_server import RelayProcess
from testing.rigs import RIGS
from testing.rigs.rig import Rig
from tests.http.test_mcp import connect, text

pytestmark = pytest.mark.slow  # needs a relay process: seconds

CREATE_TIMEOUT_S = 3
MAX_WAIT_S = 1.5


def _eventually(check: Callable[[], bool], what: str, within_s: float = 15) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RelayProcess, Rig, Rig]]:
    tmp_path = tmp_path_factory.mktemp("routing")
    with (
        RIGS["e2b"].started(tmp_path / "e2b") as e2b,
        RIGS["vercel"].started(tmp_path / "vercel") as vercel,
    ):
        server = RelayProcess(
            tmp_path / "relay",
            **{**e2b.values, **vercel.values, "providers": "e2b,vercel"},
            create_timeout_s=CREATE_TIMEOUT_S,
            max_wait_s=MAX_WAIT_S,
            breaker_failures=2,
            breaker_cooldown_s=600,
            reap_interval_s=1,
            grace_s=5,
        )
        server.add_token("ops", command=True, admin=True)
        server.add_token("narrow", command=True, providers=["e2b"])
        server.start()
        try:
            yield server, e2b, vercel
        finally:
            e2b.reset()
            server.stop()
        _eventually(lambda: not e2b.alive() and not vercel.alive(), "a sandbox was left alive")


def _codes(run: dict[str, Any]) -> list[tuple[str, str | None]]:
    return [(a["provider"], (a["error"] or {}).get("code")) for a in run["attempts"]]


async def test_an_mcp_call_is_told_of_a_failover_as_progress(
    relay: tuple[RelayProcess, Rig, Rig],
) -> None:
    server, e2b, _ = relay
    seen: list[str | None] = []

    async def progress(done: float, total: float | None, message: str | None) -> None:
        seen.append(message)

    e2b.faults.create_status = 500
    try:
        async with connect(server, server.tokens["ops"]) as client:
            result = await client.call_tool(
                "run_command", {"command": ["sh", "-c", "echo moved"]}, progress_callback=progress
            )
    finally:
        e2b.reset()
    assert not result.is_error and text(result) == "moved\n"
    assert seen[0] == "e2b: unavailable while creating the sandbox; trying vercel"
    assert "moved\n" in seen
    # E2B works again: one run there closes the count of its failures in a row.
    again = server.post(server.tokens["ops"], {"command": ["true"]})
    assert _codes(again.json()) == [("e2b", None)]


def test_a_hanging_provider_is_failed_over_then_skipped_by_its_open_breaker(
    relay: tuple[RelayProcess, Rig, Rig],
) -> None:
    server, e2b, vercel = relay
    ops = server.tokens["ops"]
    e2b.faults.create_hang = True

    # A waiting caller gets its 202 at the relay's max wait, not after every attempt.
    began = time.monotonic()
    answer = server.post(ops, {"command": ["sh", "-c", "echo routed"]})
    assert answer.status_code == 202, answer.text
    assert time.monotonic() - began < CREATE_TIMEOUT_S
    run = server.wait_final(ops, answer.json()["id"])
    assert run["state"] == "succeeded" and run["stdout"] == "routed\n", run
    assert run["provider"] == "vercel" and run["sandbox_id"] in vercel.created()
    assert _codes(run) == [("e2b", "provider_timeout"), ("vercel", None)]

    # `relay exec` says on stderr why the run moved on, one line per failed attempt.
    done = subprocess.run(
        [sys.executable, "-m", "relay", "exec", "--", "sh", "-c", "echo via-cli"],
        cwd=server.root,
        env={"PATH": os.environ["PATH"], "RELAY_URL": server.url, "RELAY_TOKEN": ops},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stdout) == (0, "via-cli\n"), done.stderr
    assert done.stderr == f"e2b: create timed out after {CREATE_TIMEOUT_S} s; trying vercel\n"

    # Two failures in a row: E2B's breaker is open, on /v1/health and /metrics.
    health = server.get(ops, "/v1/health").json()
    breakers = {p["name"]: p["breaker"] for p in health["providers"]}
    assert breakers["e2b"]["state"] == "open" and breakers["e2b"]["consecutive_failures"] == 2
    assert breakers["e2b"]["failovers"]["provider_timeout"] == 2
    assert breakers["vercel"]["state"] == "closed"
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'relay_provider_breaker_state{provider="e2b"} 2.0' in metrics
    assert 'relay_provider_breaker_state{provider="vercel"} 0.0' in metrics
    assert 'relay_route_attempts_total{code="provider_timeout",provider="e2b"} 2.0' in metrics
    assert 'relay_route_failovers_total{code="provider_timeout",provider="e2b"} 2.0' in metrics

    # While it is open, a run goes straight to Vercel: E2B sees no create at all.
    e2b.reset()
    creates = e2b.fake.ledger.create_attempts  # type: ignore[attr-defined]
    quick = server.post(ops, {"command": ["sh", "-c", "echo skipped"]})
    assert quick.status_code == 200, quick.text
    assert _codes(quick.json()) == [("vercel", None)]
    assert e2b.fake.ledger.create_attempts == creates  # type: ignore[attr-defined]


def test_a_route_filtered_to_nothing_is_a_422_naming_each_providers_reason(
    relay: tuple[RelayProcess, Rig, Rig],
) -> None:
    server, _, _ = relay
    refused = server.post(server.tokens["narrow"], {"command": ["true"], "size": "large"})
    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    assert error["code"] == "no_route"
    assert "e2b: E2B sandbox sizes are fixed" in error["message"]
    assert "vercel: this token may not use provider 'vercel'" in error["message"]
