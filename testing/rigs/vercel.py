"""The Vercel rig: the real ``vercel-sandbox`` SDK against the protocol fake
(``testing/fakes/vercel``)."""

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
    from testing.fakes.vercel import FakeVercel

TOKEN = "vercel-test-token"
TEAM = "team_relaytest"
PROJECT = "prj_relaytest"


class VercelRig(FakeRig):
    """Vercel's Sandbox API on loopback; sandboxes are known by name."""

    name = "vercel"
    module = "testing.fakes.vercel"
    id_field = "name"
    keys = {"vercel_token": TOKEN, "vercel_team_id": TEAM, "vercel_project_id": PROJECT}
    environment = ("VERCEL_",)
    variants = {
        "impatient": {"create_timeout_s": IMPATIENT_CREATE_TIMEOUT_S},
        "bad_key": {"vercel_token": BAD_KEY},
        "unreachable": {"vercel_base_url": UNREACHABLE_URL},
    }

    @classmethod
    def urls(cls, url: str) -> dict[str, object]:
        return {"vercel_base_url": url}

    @property
    def secrets(self) -> tuple[str, ...]:
        from testing.fakes.vercel import BODY_MARKER  # in every error body of the fake

        return (TOKEN, BAD_KEY, BODY_MARKER, "sk-should-never-leak")

    def settings(self, **overrides: object) -> Settings:
        return settings_for(self.fake, **{**self.overrides, **overrides})


def settings_for(fake: FakeVercel, **overrides: object) -> Settings:
    """Settings pointing the provider at ``fake`` (no .env file, explicit credentials)."""
    values: dict[str, object] = {
        "providers": ["vercel"],
        **VercelRig.keys,
        **VercelRig.urls(fake.url),
        "cluster": "test",
        "create_timeout_s": 10.0,
        **overrides,
    }
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]
