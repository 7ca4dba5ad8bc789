"""What a provider supplies to run the shared contract suite.

Each provider's ``tests/contract/test_<name>.py`` opens a :class:`Harness` (its
``open_harness(tmp_path)``) and joins the suites (``suite.py``, ``fault_suite.py``) with one
test class whose ``harness`` fixture yields it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from relay.providers.contract import Provider

Fault = Literal[
    "create_status",
    "create_hang",
    "create_allocates_then_fails",
    "cut_stream",
    "terminate_failures",
    "vanish_after_s",
]
"""The fault knobs every protocol fake (E2B, Modal, Vercel) and the memory world have."""

Variant = Literal["impatient", "bad_key", "unreachable"]
"""Other providers on the same fake: ``impatient`` has a create timeout of
:data:`IMPATIENT_CREATE_TIMEOUT_S`, ``bad_key`` a key every fake refuses, ``unreachable`` a
URL nothing listens on (and whatever create timeout lets it tell that apart from a hang)."""

IMPATIENT_CREATE_TIMEOUT_S = 1.0
UNREACHABLE_URL = "http://127.0.0.1:9"  # the discard port: nothing listens there
BAD_KEY = "bad-key"  # every fake refuses it


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


class FaultyFake(Protocol):
    """What :class:`FakeFaults` needs of a fake: its fault knobs, its ledger and a reset."""

    @property
    def faults(self) -> Any: ...

    @property
    def ledger(self) -> Any: ...

    def reset(self) -> None: ...


@dataclass
class FakeFaults:
    """:class:`Faults` over a protocol fake, whose knobs all share the :data:`Fault` names."""

    fake: FaultyFake
    secrets: tuple[str, ...]
    build: Callable[..., Provider]
    """A provider on the same fake, from settings overrides."""
    variants: Mapping[Variant, Mapping[str, object]]
    """The settings overrides that make each :data:`Variant`."""
    id_field: str = "sandbox_id"
    """The key of a sandbox's id in the fake's ``ledger.created`` entries."""

    def inject(self, fault: Fault, value: object) -> None:
        if not hasattr(self.fake.faults, fault):
            raise AssertionError(f"{type(self.fake).__name__} cannot inject {fault}")
        setattr(self.fake.faults, fault, value)

    def clear(self) -> None:
        self.fake.reset()

    def created(self) -> list[str]:
        return [str(entry[self.id_field]) for entry in self.fake.ledger.created]

    def provider(self, variant: Variant) -> Provider:
        return self.build(**self.variants[variant])


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
