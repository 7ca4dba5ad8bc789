"""The Sprites rig: the real ``sprites-py`` SDK against the protocol fake
(``testing/fakes/sprites``)."""

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
    from testing.fakes.sprites import FakeSprites

TOKEN = "sprites-test-token"


class SpritesRig(FakeRig):
    """The Sprites API and its exec WebSocket on loopback; sprites are known by name and
    have no lifetime of their own (the ledger reads the one the relay's labels give)."""

    name = "sprites"
    module = "testing.fakes.sprites"
    id_field = "name"
    keys = {"sprites_token": TOKEN}
    environment = ("SPRITE_", "SPRITES_")  # SPRITE_TOKEN, SPRITES_CLIENT_SIGNALS
    variants = {
        "impatient": {"create_timeout_s": IMPATIENT_CREATE_TIMEOUT_S},
        "bad_key": {"sprites_token": BAD_KEY},
        "unreachable": {"sprites_base_url": UNREACHABLE_URL},
    }

    @classmethod
    def urls(cls, url: str) -> dict[str, object]:
        return {"sprites_base_url": url}

    @property
    def secrets(self) -> tuple[str, ...]:
        from testing.fakes.sprites import BODY_MARKER  # in every error body of the fake

        return (TOKEN, BAD_KEY, BODY_MARKER, "sk-should-never-leak")

    def settings(self, **overrides: object) -> Settings:
        return settings_for(self.fake, **{**self.overrides, **overrides})


def settings_for(fake: FakeSprites, **overrides: object) -> Settings:
    """Settings pointing the provider at ``fake`` (no .env file, explicit credentials)."""
    values: dict[str, object] = {
        "providers": ["sprites"],
        **SpritesRig.keys,
        **SpritesRig.urls(fake.url),
        "cluster": "test",
        "create_timeout_s": 10.0,
        **overrides,
    }
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]
