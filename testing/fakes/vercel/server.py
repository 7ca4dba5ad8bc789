"""Serve the fake Vercel on 127.0.0.1 in a background thread (testing/fakes/threaded.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from testing.fakes.threaded import RunningFake, serving
from testing.fakes.vercel.app import build_app
from testing.fakes.vercel.ledger import Faults, Ledger
from testing.fakes.vercel.world import World


class FakeVercel(RunningFake[World]):
    """A running fake Vercel: its URL, ground truth and fault switches."""

    @property
    def ledger(self) -> Ledger:
        return self.world.ledger

    @property
    def faults(self) -> Faults:
        return self.world.faults


@contextmanager
def running_fake(port: int = 0) -> Iterator[FakeVercel]:
    """Serve a fresh fake; on exit kill every process it started and stop serving."""
    with serving("Vercel", World, lambda world, url: build_app(world), port, ws="none") as (
        url,
        world,
        loop,
    ):
        yield FakeVercel(url=url, world=world, loop=loop)
