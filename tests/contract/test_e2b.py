"""Contract harness for E2B: the real ``e2b`` SDK against the protocol-level fake."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from relay.providers.base import Provider
from relay.providers.e2b import E2BProvider
from relay.settings import Settings
from testing.fakes.e2b import FakeE2B, running_fake
from tests.contract.fault_suite import FaultContract
from tests.contract.harness import (
    BAD_KEY,
    IMPATIENT_CREATE_TIMEOUT_S,
    UNREACHABLE_URL,
    FakeFaults,
    Harness,
    Variant,
)
from tests.contract.suite import ProviderContract, checked


def settings_for(fake: FakeE2B, **overrides: object) -> Settings:
    """Settings pointing the E2B provider at ``fake`` (nothing read from the environment)."""
    values: dict[str, object] = {
        "providers": ["e2b"],
        "e2b_api_key": "test-key",
        "e2b_api_url": fake.url,
        "e2b_sandbox_url": fake.url,
        **overrides,
    }
    return Settings(_env_file=None, **values)  # type: ignore[arg-type]


VARIANTS: dict[Variant, dict[str, object]] = {
    "impatient": {"create_timeout_s": IMPATIENT_CREATE_TIMEOUT_S},
    "bad_key": {"e2b_api_key": BAD_KEY},
    # The SDK gives up on a refused connection after ~4 s of its own retries: a shorter
    # create timeout would answer ProviderTimeout first.
    "unreachable": {"e2b_api_url": UNREACHABLE_URL, "e2b_sandbox_url": UNREACHABLE_URL},
}


def faults_of(fake: FakeE2B) -> FakeFaults:
    """Fault injection through the fake's own knobs; "injected" is in every error body."""

    def build(**overrides: object) -> Provider:
        return E2BProvider(settings_for(fake, cluster="test", **overrides))

    return FakeFaults(fake, ("test-key", BAD_KEY, "injected"), build, VARIANTS)


@asynccontextmanager
async def open_harness(tmp_path: Path) -> AsyncIterator[Harness]:
    with running_fake() as fake:
        provider = E2BProvider(settings_for(fake, cluster="test"))

        async def alive() -> set[str]:
            return fake.ledger.alive()

        async def lifetime_of(sandbox_id: str) -> float | None:
            entry = fake.ledger.create_of(sandbox_id)
            return None if entry is None else float(entry["timeout"])

        async def tags_of(sandbox_id: str) -> dict[str, str]:
            entry = fake.ledger.create_of(sandbox_id)
            return {} if entry is None else dict(entry["metadata"])

        try:
            yield Harness(provider, alive, lifetime_of, tags_of, faults=faults_of(fake))
        finally:
            await provider.aclose()


class TestE2B(ProviderContract, FaultContract):
    """The contract on E2B."""

    @pytest.fixture
    async def harness(self, tmp_path: Path) -> AsyncIterator[Harness]:
        async with checked(open_harness(tmp_path)) as opened:
            yield opened
