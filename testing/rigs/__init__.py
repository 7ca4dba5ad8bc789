"""One rig per provider (``rig.py`` says what a rig is) and the one list of them.

:data:`RIGS` has a rig for every name in ``relay/providers/registry.py`` (a test fails
otherwise: ``tests/test_rigs.py``); every table of providers in the tests and the benchmarks
is read from it, so a new provider is in all of them once its rig is here.
"""

from __future__ import annotations

from testing.rigs.cloudflare import CloudflareRig
from testing.rigs.daytona import DaytonaRig
from testing.rigs.e2b import E2BRig
from testing.rigs.exedev import ExedevRig
from testing.rigs.local import LocalRig
from testing.rigs.memory import MemoryRig
from testing.rigs.modal import ModalRig
from testing.rigs.rig import Rig
from testing.rigs.sprites import SpritesRig
from testing.rigs.vercel import VercelRig

__all__ = ["ON_FAKES", "RIGS", "Rig"]

RIGS: dict[str, type[Rig]] = {
    rig.name: rig
    for rig in (
        LocalRig,
        E2BRig,
        ModalRig,
        VercelRig,
        SpritesRig,
        DaytonaRig,
        ExedevRig,
        CloudflareRig,
        MemoryRig,
    )
}
"""Every provider's rig, by provider name, in the order of the provider registry."""

ON_FAKES: tuple[str, ...] = tuple(name for name, rig in RIGS.items() if rig.served)
"""The providers whose real SDK runs against a protocol fake here (the cloud ones)."""
