"""Sandbox sources: what a run opens its sandbox through, composed rather than branched on.

A run asks one thing of the layer below it: ``sandbox(spec)`` → a live sandbox, always
ended (:class:`~relay.providers.contract.SandboxSource`). A provider answers it by creating
one. :class:`PooledSource` is a source of the same shape wrapping a provider: a sandbox of
the spec's shape claimed from its warm pool, else the provider's cold one, the way an httpx
mount wraps a transport. The runner hands each run its door (:func:`sources_for` makes one
per provider); the run task opens it and never knows which kind it holds: the sandbox's
:class:`~relay.providers.contract.Provenance` says where it came from.

A route (several providers, each with its pool, tried in order) is a source of this shape
too: relay/runs/route.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

from relay.providers.contract import Provider, Sandbox, SandboxSource, SandboxSpec
from relay.runs.pools import Pools


class PooledSource:
    """A provider behind its warm pools: ``sandbox(spec)`` serves a ready sandbox made for
    the spec's job and shape (claimed for the spec's run, its lifetime extended where the
    provider can), else creates one as the provider does. Either way leaving terminates it."""

    def __init__(self, name: str, provider: Provider, pools: Pools) -> None:
        self.name = name
        self.provider = provider
        self.pools = pools

    @asynccontextmanager
    async def sandbox(self, spec: SandboxSpec) -> AsyncIterator[Sandbox]:
        claimed = await self.pools.claim(self.name, spec)
        if claimed is None:  # no pool of this shape, none ready, or another run won it
            async with self.provider.sandbox(spec) as box:
                yield box
            return
        async with claimed.serving() as pooled:
            yield pooled


def sources_for(providers: Mapping[str, Provider], pools: Pools) -> dict[str, SandboxSource]:
    """Each provider's door: behind its pools where it has any, else the provider itself."""
    return {
        name: PooledSource(name, provider, pools) if pools.serve(name) else provider
        for name, provider in providers.items()
    }
