"""Contract harness for Daytona: the real ``daytona`` SDK against the protocol-level fake."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from relay.providers.base import Provider
from relay.providers.daytona import DaytonaProvider
from relay.settings import Settings
from testing.fakes.daytona import BAD_KEY, BODY_MARKER, FakeDaytona, running_fake
from tests.contract.fault_suite import FaultContract
from tests.contract.harness import (
    IMPATIENT_CREATE_TIMEOUT_S,
    UNREACHABLE_URL,
    FakeFaults,
    Harness,
    Variant,
)
from tests.contract.suite import ProviderContract, checked

KEY = "daytona-test-key"


def settings_for(fake: FakeDaytona, **overrides: object) -> Settings:
    """Settings pointing the provider at ``fake`` (no .env file, explicit credentials)."""
    values: dict[str, object] = {
        "providers": ["daytona"],
        "daytona_api_key": KEY,
        "daytona_api_url": fake.api_url,
        "cluster": "test",
        "create_timeout_s": 10.0,
        **overrides,
    }
    return Settings(_env_file=None, **values)  # type: ignore[arg-type]


VARIANTS: dict[Variant, dict[str, object]] = {
    "impatient": {"create_timeout_s": IMPATIENT_CREATE_TIMEOUT_S},
    "bad_key": {"daytona_api_key": BAD_KEY},
    "unreachable": {"daytona_api_url": f"{UNREACHABLE_URL}/api"},
}


def faults_of(fake: FakeDaytona) -> FakeFaults:
    """Fault injection through the fake's own knobs; its error bodies carry BODY_MARKER."""

    def build(**overrides: object) -> Provider:
        return DaytonaProvider(settings_for(fake, **overrides))

    return FakeFaults(fake, (KEY, BAD_KEY, BODY_MARKER), build, VARIANTS)


@asynccontextmanager
async def open_harness(tmp_path: Path) -> AsyncIterator[Harness]:
    with running_fake() as fake:
        provider = DaytonaProvider(settings_for(fake))

        async def alive() -> set[str]:
            return fake.ledger.alive()

        async def lifetime_of(sandbox_id: str) -> float | None:
            return fake.ledger.lifetime_of(sandbox_id)

        async def tags_of(sandbox_id: str) -> dict[str, str]:
            return fake.ledger.tags_of(sandbox_id)

        try:
            # TTL is counted in whole minutes: the provider-side deadline is up to 60 s late.
            yield Harness(
                provider, alive, lifetime_of, tags_of, faults=faults_of(fake), lifetime_slack_s=60
            )
        finally:
            await provider.aclose()


class TestDaytona(ProviderContract, FaultContract):
    """The contract on Daytona."""

    @pytest.fixture
    async def harness(self, tmp_path: Path) -> AsyncIterator[Harness]:
        async with checked(open_harness(tmp_path)) as opened:
            yield opened
