"""Serve the fake Worker on 127.0.0.1 in a background thread (testing/fakes/threaded.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from testing.fakes.cloudflare.app import build_app
from testing.fakes.cloudflare.ledger import Faults, Ledger
from testing.fakes.cloudflare.world import INSTANCE_TYPE_NAMES, World
from testing.fakes.threaded import RunningFake, serving

KEY = "fake-worker-key-4f1c9a0b7e2d4c6a8f3b"
"""The key the fake Worker is configured with (at least 32 characters, as the Worker needs)."""


class FakeCloudflare(RunningFake[World]):
    """A running fake job Worker: its URL, ground truth and fault switches."""

    @property
    def ledger(self) -> Ledger:
        return self.world.ledger

    @property
    def faults(self) -> Faults:
        return self.world.faults


@contextmanager
def running_fake(
    port: int = 0,
    *,
    key: str | None = KEY,
    output_limit_bytes: int = 1_048_576,
    deployed: tuple[str, ...] = INSTANCE_TYPE_NAMES,
    open_auth: bool = False,
) -> Iterator[FakeCloudflare]:
    """Serve a fresh fake Worker; ``key=None`` is a Worker whose secret was never set (it
    refuses everything), ``open_auth`` one that answers without a key (as Cloudflare's
    Sandbox Bridge does with its key unset).

    On exit every process it started is killed and it stops serving."""
    with serving(
        "Cloudflare",
        lambda: World(output_limit_bytes, deployed),
        lambda world, url: build_app(world, key, open_auth),
        port,
    ) as (url, world, loop):
        yield FakeCloudflare(url=url, world=world, loop=loop)
