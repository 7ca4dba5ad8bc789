"""The Modal rig: the real ``modal`` client against the protocol fake (``testing/fakes/modal``)."""

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
    from testing.fakes.modal import FakeModal

SECRET = "as-test"


class ModalRig(FakeRig):
    """Modal's control plane and task command router, over gRPC on one loopback port."""

    name = "modal"
    module = "testing.fakes.modal"
    keys = {"modal_token_id": "ak-test", "modal_token_secret": SECRET}
    environment = ("MODAL_",)
    variants = {
        "impatient": {"create_timeout_s": IMPATIENT_CREATE_TIMEOUT_S},
        "bad_key": {"modal_token_secret": BAD_KEY},
        # The client retries its first connection for a minute: the create timeout is what
        # lets the provider answer ProviderUnavailable sooner.
        "unreachable": {
            "modal_server_url": UNREACHABLE_URL,
            "create_timeout_s": IMPATIENT_CREATE_TIMEOUT_S,
        },
    }

    @classmethod
    def urls(cls, url: str) -> dict[str, object]:
        return {"modal_server_url": url}

    @property
    def secrets(self) -> tuple[str, ...]:
        return (SECRET, BAD_KEY, "fake:")  # the fake's gRPC details all start "fake:"

    def settings(self, **overrides: object) -> Settings:
        return settings_for(self.fake, **{**self.overrides, **overrides})

    def lifetime_of(self, sandbox_id: str) -> float | None:
        entry = self.fake.ledger.created_entry(sandbox_id)
        return None if entry is None else float(entry["lifetime"])

    def tags_of(self, sandbox_id: str) -> dict[str, str]:
        entry = self.fake.ledger.created_entry(sandbox_id)
        return {} if entry is None else dict(entry["tags"])


def settings_for(fake: FakeModal, **overrides: object) -> Settings:
    """Settings pointing at ``fake``; nothing is read from the environment or a .env file."""
    values: dict[str, object] = {
        "providers": ["modal"],
        "cluster": "test",
        **ModalRig.keys,
        **ModalRig.urls(fake.url),
        "modal_app": "relay-test",
        "create_timeout_s": 10.0,
    }
    values.update(overrides)
    return Settings(_env_file=None, **values)  # type: ignore[arg-type]
