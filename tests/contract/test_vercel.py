"""Contract harness for the Vercel provider: the real SDK against the protocol fake."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from relay.providers.base import Provider
from relay.providers.vercel import VercelProvider
from relay.settings import Settings
from testing.fakes.vercel import BAD_KEY, BODY_MARKER, FakeVercel, running_fake
from tests.contract.fault_suite import FaultContract
from tests.contract.harness import (
    IMPATIENT_CREATE_TIMEOUT_S,
    UNREACHABLE_URL,
    FakeFaults,
    Harness,
    Variant,
)
from tests.contract.suite import ProviderContract, checked

TOKEN = "vercel-test-token"
TEAM = "team_relaytest"
PROJECT = "prj_relaytest"


def settings_for(fake: FakeVercel, **overrides: object) -> Settings:
    """Settings pointing the provider at ``fake`` (no .env file, explicit credentials)."""
    values: dict[str, object] = {
        "providers": ["vercel"],
        "vercel_token": TOKEN,
        "vercel_team_id": TEAM,
        "vercel_project_id": PROJECT,
        "vercel_base_url": fake.url,
        "cluster": "test",
        "create_timeout_s": 10.0,
        **overrides,
    }
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]


VARIANTS: dict[Variant, dict[str, object]] = {
    "impatient": {"create_timeout_s": IMPATIENT_CREATE_TIMEOUT_S},
    "bad_key": {"vercel_token": BAD_KEY},
    "unreachable": {"vercel_base_url": UNREACHABLE_URL},
}


def faults_of(fake: FakeVercel) -> FakeFaults:
    """Fault injection through the fake's own knobs; its error bodies carry BODY_MARKER."""

    def build(**overrides: object) -> Provider:
        return VercelProvider(settings_for(fake, **overrides))

    secrets = (TOKEN, BAD_KEY, BODY_MARKER, "sk-should-never-leak")
    return FakeFaults(fake, secrets, build, VARIANTS, id_field="name")


@asynccontextmanager
async def open_harness(tmp_path: Path) -> AsyncIterator[Harness]:
    with running_fake() as fake:
        provider = VercelProvider(settings_for(fake))

        async def alive() -> set[str]:
            return fake.ledger.alive()

        async def lifetime_of(sandbox_id: str) -> float | None:
            return fake.ledger.lifetime_of(sandbox_id)

        async def tags_of(sandbox_id: str) -> dict[str, str]:
            return fake.ledger.tags_of(sandbox_id)

        try:
            yield Harness(provider, alive, lifetime_of, tags_of, faults=faults_of(fake))
        finally:
            await provider.aclose()


class TestVercel(ProviderContract, FaultContract):
    """The contract on Vercel."""

    @pytest.fixture
    async def harness(self, tmp_path: Path) -> AsyncIterator[Harness]:
        async with checked(open_harness(tmp_path)) as opened:
            yield opened
