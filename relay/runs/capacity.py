"""Per-provider caps of runs at once, beside the breakers: whether a provider of a route can
take this run now.

A run is counted on the provider its row names (``runs.provider``), in the store, so a cap
holds across replicas: the admission places a new run on the first provider of its route
with room (relay/store/limits.py, in the transaction that inserts it), and a route moving
on to another provider moves the count there with a conditional update under the same lock
(:meth:`Capacity.take`), or finds it full and skips it like an open breaker (a skip, not a
failed attempt). Where neither provider is capped, nothing is read or written: a relay with
no caps does no store work for them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from relay.providers.contract import Provider
from relay.settings import Settings


def caps_of(settings: Settings, providers: Mapping[str, Provider]) -> dict[str, int]:
    """Each provider's cap of runs at once, where it has one: a cloud provider's from its
    own settings model (``RELAY_E2B_MAX_CONCURRENT``), else ``RELAY_<NAME>_MAX_CONCURRENT``
    of the relay's settings (local, memory)."""
    caps: dict[str, int] = {}
    for name, provider in providers.items():
        model = getattr(provider, "settings_model", None)
        if model is not None:
            cap = settings.section(model).max_concurrent
        else:
            cap = getattr(settings, f"{name}_max_concurrent", None)
        if isinstance(cap, int):
            caps[name] = cap
    return caps


class RunMover(Protocol):
    """The store's side of a move (relay/store/database.py: ``Store.move_run``)."""

    async def move_run(self, run_id: str, to: str, cap: int | None) -> bool: ...


class Capacity:
    """Every provider's cap (``RELAY_<NAME>_MAX_CONCURRENT``), counted in the store."""

    def __init__(self, caps: Mapping[str, int], store: RunMover | None = None) -> None:
        self.caps = dict(caps)
        self.store = store

    def capped(self, provider: str) -> bool:
        return provider in self.caps

    async def take(self, run_id: str, held: str, provider: str) -> bool:
        """Count run ``run_id`` (counted on ``held`` so far) on ``provider`` if it has room:
        False when it is at its cap. No store work unless one of the two is capped."""
        if provider == held or self.store is None:
            return True
        if not (self.capped(provider) or self.capped(held)):
            return True
        return await self.store.move_run(run_id, provider, self.caps.get(provider))

    def refusal(self, provider: str) -> str:
        """Why a route skipped ``provider`` (a skip reason, not an attempt)."""
        return f"at its cap of {self.caps.get(provider)} runs at once"
