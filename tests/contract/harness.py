"""What the contract suites see of a provider: a :class:`Harness`, opened from its rig.

Each provider's ``tests/contract/test_<name>.py`` is one class joining the suites
(``suite.py``, ``fault_suite.py``) and naming its rig (``testing/rigs``);
:func:`open_harness` starts that rig and wraps it as the suites want it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from relay.providers.contract import Provider
from testing.rigs.rig import (
    BAD_KEY,
    IMPATIENT_CREATE_TIMEOUT_S,
    UNREACHABLE_URL,
    Fault,
    Rig,
    Variant,
)

__all__ = [
    "BAD_KEY",
    "IMPATIENT_CREATE_TIMEOUT_S",
    "UNREACHABLE_URL",
    "Fault",
    "Faults",
    "Harness",
    "Variant",
    "open_harness",
]


class Faults(Protocol):
    """Fault injection into a harness's fake, for the fault half of the contract (§4.3, §4.4)."""

    secrets: tuple[str, ...]
    """Strings that must never reach an error or a log: the keys, the fake's error-body words."""

    def inject(self, fault: Fault, value: object) -> None:
        """Arm ``fault`` for every call that follows, until :meth:`clear`."""

    def clear(self) -> None:
        """Disarm every fault (and release a create left hanging)."""

    def created(self) -> list[str]:
        """Ids of every sandbox the fake allocated, those whose create failed included."""

    def provider(self, variant: Variant) -> Provider:
        """A second provider on the same fake, differing as ``variant`` says; caller closes it."""


@dataclass
class RigFaults:
    """:class:`Faults` through a rig's fault switches (every :data:`Fault` name on each)."""

    rig: Rig
    secrets: tuple[str, ...]

    def inject(self, fault: Fault, value: object) -> None:
        if not hasattr(self.rig.faults, fault):
            raise AssertionError(f"the {self.rig.name} rig cannot inject {fault}")
        setattr(self.rig.faults, fault, value)

    def clear(self) -> None:
        self.rig.reset()

    def created(self) -> list[str]:
        return self.rig.created()

    def provider(self, variant: Variant) -> Provider:
        return self.rig.provider(variant)


@dataclass
class Harness:
    """A provider under test plus the ground truth about its sandboxes."""

    provider: Provider
    alive: Callable[[], Awaitable[set[str]]]
    """Ids of sandboxes still alive, from the ledger of a fake or the process table."""
    lifetime_of: Callable[[str], Awaitable[float | None]]
    """The provider-side lifetime (seconds) a sandbox was created with."""
    tags_of: Callable[[str], Awaitable[dict[str, str]]]
    """The tags (metadata, labels) a sandbox was created with."""
    image: str | None = None
    faults: Faults | None = None
    """Fault injection, where the provider runs against a fake (or the memory world)."""
    lifetime_slack_s: float = 5.0
    """How far past the asked lifetime the provider's own may be (Daytona counts minutes)."""


@asynccontextmanager
async def open_harness(
    rig_class: type[Rig], tmp_path: Path, variant: str | None = None
) -> AsyncIterator[Harness]:
    """Start the rig (as ``variant``) and give the suites its provider and ground truth."""
    with rig_class.started(tmp_path, variant) as rig:
        provider = rig.provider()

        async def alive() -> set[str]:
            return rig.alive()

        async def lifetime_of(sandbox_id: str) -> float | None:
            return rig.lifetime_of(sandbox_id)

        async def tags_of(sandbox_id: str) -> dict[str, str]:
            return rig.tags_of(sandbox_id)

        faults = RigFaults(rig, rig.secrets) if rig.faulty else None
        try:
            yield Harness(
                provider,
                alive,
                lifetime_of,
                tags_of,
                image=rig.image,
                faults=faults,
                lifetime_slack_s=rig.lifetime_slack_s,
            )
        finally:
            await provider.aclose()
