"""The Cloudflare rig: the relay's provider (httpx, no SDK) against the protocol fake of the
job Worker (``testing/fakes/cloudflare``), which answers the Worker's ``openapi.yaml``."""

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
    from testing.fakes.cloudflare import FakeCloudflare


KEY = "fake-worker-key-4f1c9a0b7e2d4c6a8f3b"
"""The fake Worker's key (``testing.fakes.cloudflare.KEY``; spelt here so the registry of rigs
reads it without importing the fake)."""


class CloudflareRig(FakeRig):
    """The job Worker on loopback; sandboxes are its jobs, known by id."""

    name = "cloudflare"
    module = "testing.fakes.cloudflare"
    id_field = "id"
    # The Worker's URL is as much a part of what the provider needs as its key: without one
    # it does not start. Here it is a URL nothing listens on, which urls() replaces.
    keys = {"cloudflare_key": KEY, "cloudflare_url": UNREACHABLE_URL}
    variants = {
        "impatient": {"create_timeout_s": IMPATIENT_CREATE_TIMEOUT_S},
        "bad_key": {"cloudflare_key": BAD_KEY},
        "unreachable": {"cloudflare_url": UNREACHABLE_URL},
    }

    @classmethod
    def urls(cls, url: str) -> dict[str, object]:
        return {"cloudflare_url": url}

    @property
    def secrets(self) -> tuple[str, ...]:
        from testing.fakes.cloudflare import BODY_MARKER  # in every error body of the fake

        return (KEY, BAD_KEY, BODY_MARKER, "sk-should-never-leak")

    def settings(self, **overrides: object) -> Settings:
        return settings_for(self.fake, **{**self.overrides, **overrides})


def settings_for(fake: FakeCloudflare, **overrides: object) -> Settings:
    """Settings pointing the provider at ``fake`` (no .env file, explicit credentials)."""
    values: dict[str, object] = {
        "providers": ["cloudflare"],
        **CloudflareRig.keys,
        **CloudflareRig.urls(fake.url),
        "cluster": "test",
        "create_timeout_s": 10.0,
        **overrides,
    }
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]
