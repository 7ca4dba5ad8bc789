"""Contract harness for E2B: the real ``e2b`` SDK against the protocol-level fake."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from relay.providers.e2b import E2BProvider
from relay.settings import Settings
from tests.contract.harness import Harness
from tests.fakes.e2b import FakeE2B, running_fake


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
            yield Harness(provider, alive, lifetime_of, tags_of, image=None)
        finally:
            await provider.aclose()
