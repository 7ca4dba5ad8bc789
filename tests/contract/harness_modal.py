"""The Modal provider under the shared contract suite: real ``modal`` client, fake Modal."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from relay.providers.modal import ModalProvider
from relay.settings import Settings
from tests.contract.harness import Harness
from tests.fakes.modal import FakeModal, running_fake


def settings_for(fake: FakeModal, **overrides: object) -> Settings:
    """Settings pointing at ``fake``; nothing is read from the environment or a .env file."""
    values: dict[str, object] = {
        "providers": ["modal"],
        "cluster": "test",
        "modal_token_id": "ak-test",
        "modal_token_secret": "as-test",
        "modal_server_url": fake.url,
        "modal_app": "relay-test",
        "create_timeout_s": 10.0,
    }
    values.update(overrides)
    return Settings(_env_file=None, **values)  # type: ignore[arg-type]


@asynccontextmanager
async def open_harness(tmp_path: Path) -> AsyncIterator[Harness]:
    with running_fake() as fake:
        provider = ModalProvider(settings_for(fake))

        async def alive() -> set[str]:
            return fake.ledger.alive()

        async def lifetime_of(sandbox_id: str) -> float | None:
            entry = fake.ledger.created_entry(sandbox_id)
            return None if entry is None else float(entry["lifetime"])

        async def tags_of(sandbox_id: str) -> dict[str, str]:
            entry = fake.ledger.created_entry(sandbox_id)
            return {} if entry is None else dict(entry["tags"])

        try:
            yield Harness(provider=provider, alive=alive, lifetime_of=lifetime_of, tags_of=tags_of)
        finally:
            await provider.aclose()
