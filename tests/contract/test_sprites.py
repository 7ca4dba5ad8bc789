"""Contract harness for the Sprites provider: the real SDK against the protocol fake."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from relay.providers.base import Provider
from relay.providers.sprites import SpritesProvider
from relay.settings import Settings
from testing.fakes.sprites import BAD_KEY, BODY_MARKER, FakeSprites, running_fake
from tests.contract.fault_suite import FaultContract
from tests.contract.harness import (
    IMPATIENT_CREATE_TIMEOUT_S,
    UNREACHABLE_URL,
    FakeFaults,
    Harness,
    Variant,
)
from tests.contract.suite import ProviderContract, checked

TOKEN = "sprites-test-token"

__all__ = ["TOKEN", "open_harness", "running_fake", "settings_for"]


def settings_for(fake: FakeSprites, **overrides: object) -> Settings:
    """Settings pointing the provider at ``fake`` (no .env file, explicit credentials)."""
    values: dict[str, object] = {
        "providers": ["sprites"],
        "sprites_token": TOKEN,
        "sprites_base_url": fake.url,
        "cluster": "test",
        "create_timeout_s": 10.0,
        **overrides,
    }
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]


VARIANTS: dict[Variant, dict[str, object]] = {
    "impatient": {"create_timeout_s": IMPATIENT_CREATE_TIMEOUT_S},
    "bad_key": {"sprites_token": BAD_KEY},
    "unreachable": {"sprites_base_url": UNREACHABLE_URL},
}


def faults_of(fake: FakeSprites) -> FakeFaults:
    """Fault injection through the fake's own knobs; its error bodies carry BODY_MARKER."""

    def build(**overrides: object) -> Provider:
        return SpritesProvider(settings_for(fake, **overrides))

    secrets = (TOKEN, BAD_KEY, BODY_MARKER, "sk-should-never-leak")
    return FakeFaults(fake, secrets, build, VARIANTS, id_field="name")


@asynccontextmanager
async def open_harness(tmp_path: Path) -> AsyncIterator[Harness]:
    with running_fake() as fake:
        provider = SpritesProvider(settings_for(fake))

        async def alive() -> set[str]:
            return fake.ledger.alive()

        async def lifetime_of(sandbox_id: str) -> float | None:
            # Fly has no lifetime to set: this is the one the relay's reaper enforces,
            # written in the sprite's labels (see docs/providers/sprites.md).
            return fake.ledger.lifetime_of(sandbox_id)

        async def tags_of(sandbox_id: str) -> dict[str, str]:
            return fake.ledger.tags_of(sandbox_id)

        try:
            yield Harness(provider, alive, lifetime_of, tags_of, faults=faults_of(fake))
        finally:
            await provider.aclose()


class TestSprites(ProviderContract, FaultContract):
    """The contract on Fly.io Sprites."""

    @pytest.fixture
    async def harness(self, tmp_path: Path) -> AsyncIterator[Harness]:
        async with checked(open_harness(tmp_path)) as opened:
            yield opened
