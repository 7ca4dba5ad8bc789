"""Serve the fake exe.dev on 127.0.0.1 in a background thread (testing/fakes/threaded.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from testing.fakes.exedev.app import build_app
from testing.fakes.exedev.ledger import Faults, Ledger
from testing.fakes.exedev.world import World
from testing.fakes.threaded import RunningFake, serving


class FakeExedev(RunningFake[World]):
    """A running fake exe.dev: its URL, ground truth, fault switches and token office."""

    @property
    def ledger(self) -> Ledger:
        return self.world.ledger

    @property
    def faults(self) -> Faults:
        return self.world.faults

    def issue_token(
        self,
        label: str,
        *,
        cmds: tuple[str, ...] | None = None,
        tag: str | None = None,
        expires_at: float | None = None,
    ) -> str:
        """A token limited to commands (``--cmds``), a tag (``--tag``) or a time (``--exp``)."""
        return self.world.issue_token(label, cmds=cmds, tag=tag, expires_at=expires_at)


@contextmanager
def running_fake(port: int = 0) -> Iterator[FakeExedev]:
    """Serve a fresh fake; on exit kill every process it started and stop serving."""
    with serving("exe.dev", World, lambda world, url: build_app(world), port) as (url, world, loop):
        yield FakeExedev(url=url, world=world, loop=loop)
