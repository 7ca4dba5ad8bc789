"""The exe.dev rig: the real ``exedev`` SDK against the protocol fake (``testing/fakes/exedev``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from relay.providers.exedev.names import TAG_LIFETIME, tags_of
from relay.settings import Settings
from testing.rigs.rig import (
    BAD_KEY,
    IMPATIENT_CREATE_TIMEOUT_S,
    UNREACHABLE_URL,
    FakeRig,
)

if TYPE_CHECKING:
    from testing.fakes.exedev import FakeExedev

TOKEN = "exe1.relay-test-token"


class ExedevRig(FakeRig):
    """exe.dev's ``POST /exec`` on loopback; VMs are known by name, their tags are words
    (``relay-run-…``) read back into values, and the lifetime is the one the relay's tag gives
    (exe.dev has none of its own)."""

    name = "exedev"
    module = "testing.fakes.exedev"
    id_field = "name"
    keys = {"exedev_token": TOKEN}
    environment = ("EXE_",)  # EXE_TOKEN: the SDK's own, read when no token is passed
    variants = {
        "impatient": {"create_timeout_s": IMPATIENT_CREATE_TIMEOUT_S},
        "bad_key": {"exedev_token": BAD_KEY},
        "unreachable": {"exedev_url": UNREACHABLE_URL},
    }

    @classmethod
    def urls(cls, url: str) -> dict[str, object]:
        return {"exedev_url": url}

    @property
    def secrets(self) -> tuple[str, ...]:
        from testing.fakes.exedev import BODY_MARKER  # in every error body of the fake

        return (TOKEN, BAD_KEY, BODY_MARKER, "sk-should-never-leak")

    def tags_of(self, sandbox_id: str) -> dict[str, str]:
        return tags_of(self.fake.ledger.tags_of(sandbox_id))

    def lifetime_of(self, sandbox_id: str) -> float | None:
        lifetime = self.tags_of(sandbox_id).get(TAG_LIFETIME)
        return float(lifetime) if lifetime else None

    def settings(self, **overrides: object) -> Settings:
        return settings_for(self.fake, **{**self.overrides, **overrides})


def settings_for(fake: FakeExedev, **overrides: object) -> Settings:
    """Settings pointing the provider at ``fake`` (no .env file, explicit credentials)."""
    values: dict[str, object] = {
        "providers": ["exedev"],
        **ExedevRig.keys,
        **ExedevRig.urls(fake.url),
        "cluster": "test",
        "create_timeout_s": 10.0,
        **overrides,
    }
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]
