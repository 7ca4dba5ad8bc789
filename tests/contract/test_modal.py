"""The Modal provider under the shared contract suite: real ``modal`` client, fake Modal."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from relay.providers.base import Provider
from relay.providers.modal import ModalProvider
from relay.settings import Settings
from testing.fakes.modal import FakeModal, running_fake
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


VARIANTS: dict[Variant, dict[str, object]] = {
    "impatient": {"create_timeout_s": IMPATIENT_CREATE_TIMEOUT_S},
    "bad_key": {"modal_token_secret": BAD_KEY},
    # The client retries its first connection for a minute: the create timeout is what
    # lets the provider answer ProviderUnavailable sooner.
    "unreachable": {
        "modal_server_url": UNREACHABLE_URL,
        "create_timeout_s": IMPATIENT_CREATE_TIMEOUT_S,
    },
}


def faults_of(fake: FakeModal) -> FakeFaults:
    """Fault injection through the fake's own knobs; its gRPC details all start "fake:"."""

    def build(**overrides: object) -> Provider:
        return ModalProvider(settings_for(fake, **overrides))

    return FakeFaults(fake, ("as-test", BAD_KEY, "fake:"), build, VARIANTS)


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
            yield Harness(
                provider=provider,
                alive=alive,
                lifetime_of=lifetime_of,
                tags_of=tags_of,
                faults=faults_of(fake),
            )
        finally:
            await provider.aclose()


class TestModal(ProviderContract, FaultContract):
    """The contract on Modal."""

    @pytest.fixture
    async def harness(self, tmp_path: Path) -> AsyncIterator[Harness]:
        async with checked(open_harness(tmp_path)) as opened:
            yield opened
