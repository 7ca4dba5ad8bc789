"""The rig: one provider as the tests and the benchmarks drive it.

A rig answers, for one provider of ``relay/providers/registry.py``, what every cross-provider
test otherwise spells out by hand: how to start what the provider talks to (its protocol fake
on loopback, a folder of this machine, an in-memory world), which settings point a relay at
it, which of its sandboxes are alive (the ground truth, never the provider's own word), how to
break it (the fake's fault switches) and which other clients of it a test may want (variants).

The class says what needs nothing started (the registry reads it); an instance is a started
rig, made by :meth:`Rig.started`::

    with RIGS["vercel"].started(tmp_path) as rig:
        provider = rig.provider()                    # a client, as the relay builds one
        server = RelayProcess(folder, **rig.values)  # or a relay process pointed at it
        rig.faults.create_hang = True                # arm a fault (the :data:`Fault` names)
        assert rig.alive() == set()                  # nothing left, by the fake's ledger

A provider whose SDK talks to a server subclasses :class:`FakeRig` (``testing/rigs/vercel.py``
is the pattern: a class of data, two hooks and the ``settings_for(fake)`` its own tests use);
``local.py`` and ``memory.py`` show rigs with no server. A new rig is listed in
``testing/rigs/__init__.py``'s ``RIGS``; ``tests/test_rigs.py`` fails until it is.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, get_args

from relay.providers.registry import provider_class
from testing.settings import make_settings

if TYPE_CHECKING:
    from typing import Self

    from relay.providers.contract import Provider
    from relay.settings import Settings

Fault = Literal[
    "create_status",
    "create_hang",
    "create_allocates_then_fails",
    "cut_stream",
    "terminate_failures",
    "vanish_after_s",
]
"""The fault switches every protocol fake and the memory world have, by the same names:
``rig.faults.<name> = value`` arms one for every call that follows, ``rig.reset()`` disarms
them all (and releases a create left hanging)."""

Variant = Literal["impatient", "bad_key", "unreachable"]
"""The variants a rig with fault switches has for the contract's fault suite: ``impatient``
has a create timeout of :data:`IMPATIENT_CREATE_TIMEOUT_S`, ``bad_key`` a key every fake
refuses (:data:`BAD_KEY`), ``unreachable`` a URL nothing listens on (and whatever create
timeout lets it tell that apart from a hang)."""

FAULT_VARIANTS: tuple[Variant, ...] = get_args(Variant)
IMPATIENT_CREATE_TIMEOUT_S = 1.0
UNREACHABLE_URL = "http://127.0.0.1:9"  # the discard port: nothing listens there
BAD_KEY = "bad-key"  # every fake refuses it


class Rig(ABC):
    """One provider, started, pointed at, watched and broken on purpose.

    What the class says (read by the registry, ``testing/rigs/__init__.py``, without starting
    anything; a new rig sets those that differ from the defaults):

    - :attr:`name`: the provider's name in ``relay/providers/registry.py``.
    - :attr:`faulty`: it has the :data:`Fault` switches, so the contract's fault suite and the
      chaos schedules can break it; then :attr:`variants` holds :data:`FAULT_VARIANTS` too.
    - :attr:`served`: its provider talks to a server (a protocol fake here), so :attr:`keys`
      and :meth:`urls` point any settings at any URL (a silent or a hostile server).
    - :attr:`shared`: a relay process a test starts sees the same sandboxes :meth:`alive`
      does (a fake server, this machine); not so for the memory world, which lives in the
      process that made it.
    - :attr:`variants`: named settings overrides, for the rig itself (``started(tmp,
      "none")``: local without bubblewrap) or for another client of it (``provider("bad_key")``;
      a variant that is no setting, such as an unreachable memory world, :meth:`provider`
      makes by hand).
    - :attr:`keys`, :attr:`image`, :attr:`lifetime_slack_s`, :attr:`environment`: its
      credentials, and what the contract suite and the test environment need to know of it.

    What a started rig (:meth:`started`) gives:

    - :attr:`values`: the settings that point a relay at it, ``providers`` included, usable
      as ``make_settings(tmp, **rig.values)`` and as ``RelayProcess(folder, **rig.values)``.
    - :meth:`settings`, :meth:`client`, :meth:`provider`: a ``Settings`` for a client of it, a
      provider built from any settings, and one of its clients (closed by the caller).
    - :meth:`alive`, :meth:`lifetime_of`, :meth:`tags_of`, :meth:`created`: the ground truth,
      from the fake's ledger, the process table or the world.
    - :attr:`faults` and :meth:`reset`: the fault switches (``None`` where it has none),
      and :attr:`secrets`: what no answer or log line may carry while they are armed.

    A started rig holds no client of its own: whoever calls :meth:`provider` closes it, and
    leaving :meth:`started` stops the fake, which kills whatever its sandboxes still run.
    """

    name: ClassVar[str]
    """The provider's name in ``relay/providers/registry.py`` and ``RELAY_PROVIDERS``."""
    faulty: ClassVar[bool] = False
    """It has every :data:`Fault` switch and every :data:`FAULT_VARIANTS` variant."""
    served: ClassVar[bool] = False
    """Its provider talks to a server (a protocol fake in ``testing/fakes/``)."""
    shared: ClassVar[bool] = True
    """A relay process started by the test sees the sandboxes :meth:`alive` sees."""
    variants: ClassVar[Mapping[str, Mapping[str, object]]] = {}
    """Named settings overrides: a started rig's own (:meth:`started`) or another client's."""
    keys: ClassVar[Mapping[str, object]] = {}
    """The credentials its provider needs to be built (settings names to values)."""
    image: ClassVar[str | None] = None
    """The image the contract suite asks for (``None``: the provider's default)."""
    lifetime_slack_s: ClassVar[float] = 5.0
    """How far past the asked lifetime the provider's own may be (Daytona counts minutes)."""
    environment: ClassVar[tuple[str, ...]] = ()
    """Prefixes of the variables its SDK reads from the environment by itself (``E2B_``): no
    test sees a developer's (``tests/conftest.py``)."""

    faults: Any = None
    """The fault switches (:data:`Fault` attributes), or ``None`` where there is nothing to
    break; provider-specific switches (Sprites' ``policy_status``) are on it too."""

    def __init__(self, tmp_path: Path, variant: str | None = None) -> None:
        self.tmp_path = tmp_path
        self.variant = variant
        self.overrides: Mapping[str, object] = self.variants[variant] if variant else {}
        """The settings of :attr:`variant`, in :attr:`values` and every :meth:`settings`."""

    @classmethod
    @contextmanager
    def started(cls, tmp_path: Path, variant: str | None = None) -> Iterator[Self]:
        """Start what the provider talks to, with the settings of ``variant`` (one of
        :attr:`variants`); stop it, and everything it started, on leaving."""
        yield cls(tmp_path, variant)

    @classmethod
    def urls(cls, url: str) -> dict[str, object]:
        """The settings that send its provider to a server at ``url`` (a :attr:`served` rig)."""
        raise AssertionError(f"the {cls.name} provider talks to no server")

    @property
    def secrets(self) -> tuple[str, ...]:
        """Strings no error or log may carry: its keys, :data:`BAD_KEY`, the words of the
        fake's error bodies (a property: a fake's constants are imported only when used)."""
        return ()

    @property
    @abstractmethod
    def values(self) -> dict[str, object]:
        """The settings that point a relay at this rig, ``providers`` included."""

    def settings(self, **overrides: object) -> Settings:
        """Settings for a client of this rig (everything else under ``tmp_path``)."""
        return make_settings(self.tmp_path, **{**self.values, **overrides})

    def client(self, settings: Settings) -> Provider:
        """Its provider built from ``settings``, as the registry builds it; caller closes it."""
        # Not load_provider(): that also adds the keys to the log redaction of this process.
        return provider_class(self.name)(settings)  # type: ignore[call-arg]

    def provider(self, variant: str | None = None) -> Provider:
        """A client of this rig, or another one as ``variant`` makes it; caller closes it."""
        return self.client(self.settings(**(self.variants[variant] if variant else {})))

    @abstractmethod
    def alive(self) -> set[str]:
        """Ids of its sandboxes alive now, from the ground truth."""

    @abstractmethod
    def lifetime_of(self, sandbox_id: str) -> float | None:
        """The provider-side lifetime (seconds) ``sandbox_id`` was created with."""

    @abstractmethod
    def tags_of(self, sandbox_id: str) -> dict[str, str]:
        """The tags (metadata, labels) ``sandbox_id`` was created with."""

    def created(self) -> list[str]:
        """Ids of every sandbox it allocated, those whose create failed included."""
        raise AssertionError(f"the {self.name} rig keeps no ledger of creates")

    def reset(self) -> None:  # noqa: B027 - a rig with nothing to disarm needs no override
        """Disarm every fault (and release a create left hanging)."""


class FakeRig(Rig):
    """A provider whose SDK talks to a protocol fake, served on loopback for as long as the
    rig is started.

    A subclass sets :attr:`name`, :attr:`module` (the fake's package, whose
    ``running_fake()`` serves it), :attr:`keys`, :attr:`variants` (the three of
    :data:`FAULT_VARIANTS`: settings giving a short create timeout, :data:`BAD_KEY`, and
    :data:`UNREACHABLE_URL`), :attr:`environment`, and overrides :meth:`urls` and
    :attr:`secrets`. The fake's ledger is read through ``alive()``, ``lifetime_of()``,
    ``tags_of()`` and ``created`` (entries with :attr:`id_field`); override the readers a
    ledger keeps its own way (E2B's, Modal's). :meth:`settings` is the base's (everything under
    the test's folder) unless the provider's own tests already have a ``settings_for(fake)``.
    """

    faulty = True
    served = True
    module: ClassVar[str]
    """The fake's package: its ``running_fake()`` serves one on a free loopback port."""
    id_field: ClassVar[str] = "sandbox_id"
    """The key of a sandbox's id in the fake's ``ledger.created`` entries."""

    def __init__(self, tmp_path: Path, variant: str | None, fake: Any) -> None:
        super().__init__(tmp_path, variant)
        self.fake = fake
        """The running fake: its ``url``, ``ledger``, ``faults``, for a provider's own tests."""
        self.faults = fake.faults

    @classmethod
    @contextmanager
    def started(cls, tmp_path: Path, variant: str | None = None) -> Iterator[Self]:
        # Imported here: the registry is read by every test session, a fake only when used.
        with importlib.import_module(cls.module).running_fake() as fake:
            yield cls(tmp_path, variant, fake)

    @property
    def values(self) -> dict[str, object]:
        return {"providers": self.name, **self.keys, **self.urls(self.fake.url), **self.overrides}

    def alive(self) -> set[str]:
        alive: set[str] = self.fake.ledger.alive()
        return alive

    def lifetime_of(self, sandbox_id: str) -> float | None:
        lifetime: float | None = self.fake.ledger.lifetime_of(sandbox_id)
        return lifetime

    def tags_of(self, sandbox_id: str) -> dict[str, str]:
        return dict(self.fake.ledger.tags_of(sandbox_id))

    def created(self) -> list[str]:
        return [str(entry[self.id_field]) for entry in self.fake.ledger.created]

    def reset(self) -> None:
        self.fake.reset()
