"""The Daytona rig: the real ``daytona`` SDK against the protocol fake
(``testing/fakes/daytona``)."""

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
    from testing.fakes.daytona import FakeDaytona

KEY = "daytona-test-key"


class DaytonaRig(FakeRig):
    """Daytona's control API (under ``/api``) and toolbox on one loopback port."""

    name = "daytona"
    module = "testing.fakes.daytona"
    keys = {"daytona_api_key": KEY}
    environment = ("DAYTONA_",)
    # TTL is counted in whole minutes: the provider-side deadline is up to 60 s late.
    lifetime_slack_s = 60
    variants = {
        "impatient": {"create_timeout_s": IMPATIENT_CREATE_TIMEOUT_S},
        "bad_key": {"daytona_api_key": BAD_KEY},
        "unreachable": {"daytona_api_url": f"{UNREACHABLE_URL}/api"},
    }

    @classmethod
    def urls(cls, url: str) -> dict[str, object]:
        return {"daytona_api_url": f"{url}/api"}

    @property
    def secrets(self) -> tuple[str, ...]:
        from testing.fakes.daytona import BODY_MARKER  # in every error body of the fake

        return (KEY, BAD_KEY, BODY_MARKER)

    def settings(self, **overrides: object) -> Settings:
        return settings_for(self.fake, **{**self.overrides, **overrides})


def settings_for(fake: FakeDaytona, **overrides: object) -> Settings:
    """Settings pointing the provider at ``fake`` (no .env file, explicit credentials)."""
    values: dict[str, object] = {
        "providers": ["daytona"],
        **DaytonaRig.keys,
        **DaytonaRig.urls(fake.url),
        "cluster": "test",
        "create_timeout_s": 10.0,
        **overrides,
    }
    return Settings(_env_file=None, **values)  # type: ignore[arg-type]
