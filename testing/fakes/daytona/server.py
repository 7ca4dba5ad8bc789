"""Serve the fake Daytona on 127.0.0.1 in a background thread (testing/fakes/threaded.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from testing.fakes.daytona.app import build_app
from testing.fakes.daytona.world import Faults, Ledger, World
from testing.fakes.threaded import RunningFake, serving


class FakeDaytona(RunningFake[World]):
    """A running fake Daytona: its URL, ground truth and fault switches."""

    @property
    def ledger(self) -> Ledger:
        return self.world.ledger

    @property
    def faults(self) -> Faults:
        return self.world.faults

    @property
    def api_url(self) -> str:
        """The control API's base, as the SDK wants it."""
        return f"{self.url}/api"


@contextmanager
def running_fake(port: int = 0) -> Iterator[FakeDaytona]:
    """Serve a fresh fake; on exit kill every process it started and stop serving."""
    with serving("Daytona", World, build_app, port, ws="wsproto") as (url, world, loop):
        yield FakeDaytona(url=url, world=world, loop=loop)
