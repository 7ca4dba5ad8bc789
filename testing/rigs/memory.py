"""The memory rig: the shipped in-memory provider (``relay/providers/memory.py``), whose world
is the ground truth and holds the fault switches."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar

from relay.providers.memory import API_KEY, BODY_MARKER, MemoryProvider, MemoryWorld
from testing.rigs.rig import BAD_KEY, FAULT_VARIANTS, IMPATIENT_CREATE_TIMEOUT_S, Rig
from testing.settings import make_settings

if TYPE_CHECKING:
    from pathlib import Path

    from relay.providers.contract import Provider
    from relay.settings import Settings


class MemoryRig(Rig):
    """One world shared by every client of the rig; it lives in this process, so a relay
    process a test starts has a world of its own (not :attr:`shared`)."""

    name = "memory"
    faulty = True
    shared = False
    # Made in provider(): a refused key and an unreachable world are not settings.
    variants: ClassVar[Mapping[str, Mapping[str, object]]] = {v: {} for v in FAULT_VARIANTS}

    def __init__(self, tmp_path: Path, variant: str | None = None) -> None:
        super().__init__(tmp_path, variant)
        self.world = MemoryWorld()
        self.faults = self.world.faults

    @property
    def values(self) -> dict[str, object]:
        return {"providers": "memory", **self.overrides}

    @property
    def secrets(self) -> tuple[str, ...]:
        return (API_KEY, BAD_KEY, BODY_MARKER)

    def settings(self, **overrides: object) -> Settings:
        return make_settings(self.tmp_path, cluster="test", **{**self.overrides, **overrides})

    def client(self, settings: Settings) -> Provider:
        return MemoryProvider(settings, self.world)

    def provider(self, variant: str | None = None) -> Provider:
        if variant is None:
            return self.client(self.settings())
        timeout_s = IMPATIENT_CREATE_TIMEOUT_S if variant == "impatient" else 10.0
        settings = self.settings(create_timeout_s=timeout_s)
        if variant == "impatient":
            return MemoryProvider(settings, self.world)
        if variant == "bad_key":
            return MemoryProvider(settings, self.world, api_key=BAD_KEY)
        return MemoryProvider(settings, MemoryWorld(reachable=False))

    def alive(self) -> set[str]:
        return self.world.alive()

    def lifetime_of(self, sandbox_id: str) -> float | None:
        return self.world.boxes[sandbox_id].lifetime_s

    def tags_of(self, sandbox_id: str) -> dict[str, str]:
        return dict(self.world.boxes[sandbox_id].tags)

    def created(self) -> list[str]:
        return self.world.created()

    def reset(self) -> None:
        self.world.reset()
