"""Serve the fake Sprites on 127.0.0.1 in a background thread (testing/fakes/threaded.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from testing.fakes.sprites.app import build_app
from testing.fakes.sprites.world import Faults, Ledger, World
from testing.fakes.threaded import RunningFake, serving


class FakeSprites(RunningFake[World]):
    """A running fake Sprites: its URL, ground truth and fault switches."""

    @property
    def ledger(self) -> Ledger:
        return self.world.ledger

    @property
    def faults(self) -> Faults:
        return self.world.faults


@contextmanager
def running_fake(port: int = 0) -> Iterator[FakeSprites]:
    """Serve a fresh fake; on exit kill every process it started and stop serving."""
    with serving("Sprites", World, lambda world, url: build_app(world), port, ws="wsproto") as (
        url,
        world,
        loop,
    ):
        yield FakeSprites(url=url, world=world, loop=loop)
