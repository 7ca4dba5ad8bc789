"""Listing a provider's sandboxes (the reaper's one call per sweep) is bounded.

A provider that accepts the connection and then never answers must not hold the sweep for
ever: the reaper lists every provider in turn, so one silent API would stop it reaping the
others' sandboxes too. Daytona's list and Modal's gRPC calls have no timeout of their own.
"""

from __future__ import annotations

import asyncio
import time
import warnings
from collections.abc import AsyncIterator
from typing import Any

import pytest

from relay.errors import ProviderTimeout
from relay.providers.lifecycle import SandboxProvider
from relay.providers.registry import provider_class
from relay.settings import Settings
from testing.rigs import ON_FAKES, RIGS

LIST_TIMEOUT_S = 0.5


def provider_at(name: str, url: str) -> SandboxProvider[Any]:
    """The named provider with its rig's keys, sent to a server at ``url``."""
    rig = RIGS[name]
    values = {"providers": [name], "cluster": "test", **rig.keys, **rig.urls(url)}
    settings = Settings(_env_file=None, **values)  # type: ignore[arg-type]
    provider = provider_class(name)(settings)  # type: ignore[call-arg]
    assert isinstance(provider, SandboxProvider)
    return provider


@pytest.fixture
async def silent_url() -> AsyncIterator[str]:
    """A server that accepts every connection and never answers a byte."""
    writers: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    for writer in writers:
        writer.close()
    server.close()
    await server.wait_closed()


@pytest.mark.parametrize("name", sorted(ON_FAKES))
async def test_a_silent_provider_api_ends_the_listing_in_time(name: str, silent_url: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Daytona's polling-mode notice
        provider = provider_at(name, silent_url)
    provider.list_timeout_s = LIST_TIMEOUT_S
    started = time.monotonic()
    try:
        with pytest.raises(ProviderTimeout):
            await asyncio.wait_for(provider.list_owned(), 15)
    finally:
        await asyncio.wait_for(provider.aclose(), 15)
    assert time.monotonic() - started < LIST_TIMEOUT_S + 3
