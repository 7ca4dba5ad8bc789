"""The fault half of the provider contract (design §4.3 and §4.4), on every harness with a fake.

:class:`FaultContract` joins :class:`tests.contract.suite.ProviderContract` in the test class
of every provider with a fake (or a world, for memory) to inject faults into, through
``Harness.faults``. What each test
asserts is what a user would notice: which RelayError the run ends with, that no provider
body or key reaches it or the log, and that no sandbox is left alive (the fixture checks).
The local provider runs for real, with nothing to inject into: its class leaves this out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest

from relay.errors import (
    ProviderAuth,
    ProviderError,
    ProviderRateLimited,
    ProviderTimeout,
    ProviderUnavailable,
    SandboxLost,
)
from relay.providers.contract import TAG_RUN, OutputSink, Provider, Sandbox
from relay.providers.lifecycle import SandboxProvider
from tests.contract.harness import IMPATIENT_CREATE_TIMEOUT_S, Faults, Harness, Variant
from tests.contract.suite import spec

PROMPTLY_S = IMPATIENT_CREATE_TIMEOUT_S + 1
"""The create's bound, and what a loaded machine adds: the caller's answer does not wait
for the sweep after it (relay/providers/aftercare.py)."""
SWEPT_S = 15.0
"""How long the sweep going on beside serving may take to end what the create left."""


def faults_of(harness: Harness) -> Faults:
    assert harness.faults is not None  # every harness with a fake has faults
    return harness.faults


def assert_nothing_leaks(
    faults: Faults, error: BaseException, caplog: pytest.LogCaptureFixture
) -> None:
    texts = [str(error), *(record.getMessage() for record in caplog.records)]
    assert [secret for secret in faults.secrets if any(secret in text for text in texts)] == []


@asynccontextmanager
async def other_provider(faults: Faults, variant: Variant) -> AsyncIterator[Provider]:
    provider = faults.provider(variant)
    try:
        yield provider
    finally:
        await provider.aclose()


async def run_true(box: Sandbox) -> None:
    result = await box.exec(
        ["true"], stdin=None, env={}, workdir=None, timeout_s=20, output=OutputSink(9)
    )
    assert result.exit_code == 0


class FaultContract:
    """The fault half of the contract, for a provider whose harness has ``faults``."""

    @pytest.fixture(autouse=True)
    def capture_logs(self, caplog: pytest.LogCaptureFixture) -> None:
        caplog.set_level(logging.INFO)

    # --- create ----------------------------------------------------------------------------

    @pytest.mark.parametrize(
        ("status", "error"),
        [(500, ProviderUnavailable), (503, ProviderUnavailable), (429, ProviderRateLimited),
         (401, ProviderAuth), (403, ProviderAuth)],
    )  # fmt: skip
    async def test_create_errors_become_relay_errors(
        self,
        harness: Harness,
        caplog: pytest.LogCaptureFixture,
        status: int,
        error: type[ProviderError],
    ) -> None:
        faults = faults_of(harness)
        faults.inject("create_status", status)
        with pytest.raises(ProviderError) as raised:
            async with harness.provider.sandbox(spec(harness)):
                pytest.fail("no sandbox should be yielded")
        assert type(raised.value) is error
        if status == 429:
            assert raised.value.retry_after is not None and raised.value.retry_after >= 1
        assert_nothing_leaks(faults, raised.value, caplog)

    async def test_a_refused_key_is_provider_auth(
        self, harness: Harness, caplog: pytest.LogCaptureFixture
    ) -> None:
        faults = faults_of(harness)
        async with other_provider(faults, "bad_key") as provider:
            with pytest.raises(ProviderAuth) as raised:
                async with provider.sandbox(spec(harness)):
                    pytest.fail("no sandbox should be yielded")
            with pytest.raises(ProviderAuth):
                await provider.list_owned()
        assert faults.created() == []
        assert_nothing_leaks(faults, raised.value, caplog)

    async def test_an_unreachable_provider_is_unavailable(self, harness: Harness) -> None:
        faults = faults_of(harness)
        started = time.monotonic()
        async with other_provider(faults, "unreachable") as provider:
            with pytest.raises(ProviderUnavailable):
                async with provider.sandbox(spec(harness)):
                    pytest.fail("no sandbox should be yielded")
        assert time.monotonic() - started < 10  # not the minute a client may retry for

    async def test_a_hanging_create_times_out_and_leaves_nothing(self, harness: Harness) -> None:
        faults = faults_of(harness)
        faults.inject("create_hang", True)
        async with other_provider(faults, "impatient") as provider:
            # Timed from the create, not from making the provider: Daytona's client alone
            # took 0.3-0.7 s of a loaded machine, most of the margin PROMPTLY_S gives.
            started = time.monotonic()
            with pytest.raises(ProviderTimeout):
                async with provider.sandbox(spec(harness)):
                    pytest.fail("no sandbox should be yielded")
            answered = time.monotonic() - started
            # What the create left is ended beside serving, not before the answer.
            assert isinstance(provider, SandboxProvider)
            await provider.aftercare.finish(SWEPT_S)
        assert answered < PROMPTLY_S
        assert await harness.alive() == set()

    async def test_a_create_cancelled_by_the_caller_leaves_nothing(self, harness: Harness) -> None:
        faults = faults_of(harness)
        faults.inject("create_hang", True)
        with anyio.move_on_after(0.5) as scope:
            async with harness.provider.sandbox(spec(harness)):
                pytest.fail("no sandbox should be yielded")
        assert scope.cancelled_caught
        assert await harness.alive() == set()

    async def test_a_create_that_allocates_then_fails_leaves_nothing(
        self, harness: Harness, caplog: pytest.LogCaptureFixture
    ) -> None:
        faults = faults_of(harness)
        faults.inject("create_allocates_then_fails", True)
        with pytest.raises(ProviderUnavailable) as raised:
            async with harness.provider.sandbox(spec(harness, "run_allocfail")):
                pytest.fail("no sandbox should be yielded")
        allocated = faults.created()
        assert len(allocated) == 1  # one sandbox, however often the client retried
        assert (await harness.tags_of(allocated[0]))[TAG_RUN] == "run_allocfail"
        assert await harness.alive() == set()
        assert_nothing_leaks(faults, raised.value, caplog)

    # --- running ---------------------------------------------------------------------------

    async def test_a_cut_stream_is_followed_to_the_end(self, harness: Harness) -> None:
        faults_of(harness).inject("cut_stream", True)
        sink = OutputSink(1024)
        async with harness.provider.sandbox(spec(harness)) as box:
            result = await box.exec(
                ["sh", "-c", "echo one; sleep 0.5; echo two; exit 4"],
                stdin=None,
                env={},
                workdir=None,
                timeout_s=20,
                output=sink,
            )
        assert (result.exit_code, sink.text("stdout")) == (4, "one\ntwo\n")

    async def test_a_sandbox_gone_mid_run_is_sandbox_lost(
        self, harness: Harness, caplog: pytest.LogCaptureFixture
    ) -> None:
        faults = faults_of(harness)
        faults.inject("vanish_after_s", 0.5)
        started = time.monotonic()
        with pytest.raises(SandboxLost) as raised:
            async with harness.provider.sandbox(spec(harness)) as box:
                await box.exec(
                    ["sh", "-c", "echo started; sleep 30"],
                    stdin=None,
                    env={},
                    workdir=None,
                    timeout_s=30,
                    output=OutputSink(100),
                )
        assert time.monotonic() - started < 5
        assert_nothing_leaks(faults, raised.value, caplog)

    # --- terminate -------------------------------------------------------------------------

    async def test_a_failed_terminate_is_raised_logged_and_left_to_the_reaper(
        self, harness: Harness, caplog: pytest.LogCaptureFixture
    ) -> None:
        faults = faults_of(harness)
        with pytest.raises(ProviderUnavailable) as raised:
            async with harness.provider.sandbox(spec(harness, "run_stuck")) as box:
                await run_true(box)
                faults.inject("terminate_failures", 1000)  # every retry the client makes fails too
        assert box.id in await harness.alive()
        assert any(box.id in record.getMessage() for record in caplog.records)
        assert_nothing_leaks(faults, raised.value, caplog)
        # The reaper's pass, once the provider recovers: it finds the sandbox by its tags.
        faults.clear()
        owned = {ref.sandbox_id: ref.run_id for ref in await harness.provider.list_owned()}
        assert owned.get(box.id) == "run_stuck"
        await harness.provider.terminate(box.id)
        assert await harness.alive() == set()

    async def test_a_failed_terminate_does_not_mask_the_callers_error(
        self, harness: Harness
    ) -> None:
        faults = faults_of(harness)
        with pytest.raises(RuntimeError, match="the job's own failure"):
            async with harness.provider.sandbox(spec(harness)) as box:
                faults.inject("terminate_failures", 1000)
                raise RuntimeError("the job's own failure")
        assert box.id in await harness.alive()
        faults.clear()
        await harness.provider.terminate(box.id)
