"""The E2B rig: the real ``e2b`` SDK against the protocol fake (``testing/fakes/e2b``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from relay.settings import Settings
from testing.rigs.rig import (
    BAD_KEY,
    IMPATIENT_CREATE_TIMEOUT_S,
    UNREACHABLE_URL,
    FakeRig,
)

if TYPE_CHECKING:
    from testing.fakes.e2b import FakeE2B

KEY = "test-key"


class E2BRig(FakeRig):
    """E2B's control plane and envd on one loopback port; its ledger keeps each create."""

    name = "e2b"
    module = "testing.fakes.e2b"
    keys = {"e2b_api_key": KEY}
    environment = ("E2B_",)
    variants = {
        "impatient": {"create_timeout_s": IMPATIENT_CREATE_TIMEOUT_S},
        "bad_key": {"e2b_api_key": BAD_KEY},
        # The SDK gives up on a refused connection after ~4 s of its own retries: a shorter
        # create timeout would answer ProviderTimeout first.
        "unreachable": {"e2b_api_url": UNREACHABLE_URL, "e2b_sandbox_url": UNREACHABLE_URL},
    }

    @classmethod
    def urls(cls, url: str) -> dict[str, object]:
        return {"e2b_api_url": url, "e2b_sandbox_url": url}

    @property
    def secrets(self) -> tuple[str, ...]:
        return (KEY, BAD_KEY, "injected")  # "injected" is in every error body of the fake

    def settings(self, **overrides: object) -> Settings:
        return settings_for(self.fake, cluster="test", **{**self.overrides, **overrides})

    def lifetime_of(self, sandbox_id: str) -> float | None:
        entry = self.fake.ledger.create_of(sandbox_id)
        return None if entry is None else float(entry["timeout"])

    def tags_of(self, sandbox_id: str) -> dict[str, str]:
        entry = self.fake.ledger.create_of(sandbox_id)
        return {} if entry is None else dict(entry["metadata"])


def settings_for(fake: FakeE2B, **overrides: object) -> Settings:
    """Settings pointing the E2B provider at ``fake`` (nothing read from the environment)."""
    values = {"providers": ["e2b"], **E2BRig.keys, **E2BRig.urls(fake.url), **overrides}
    return Settings(_env_file=None, **values)  # type: ignore[arg-type]
