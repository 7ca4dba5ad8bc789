"""Listing a provider's sandboxes (the reaper's one call per sweep) is bounded.

A provider that accepts the connection and then never answers must not hold the sweep for
ever: the reaper lists every provider in turn, so one silent API would stop it reaping the
others' sandboxes too. Daytona's list and Modal's gRPC calls have no timeout of their own.
"""

from __future__ import annotations

import asyncio
import time
import warnings
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from relay.errors import ProviderTimeout
from relay.providers.daytona import DaytonaProvider
from relay.providers.e2b import E2BProvider
from relay.providers.lifecycle import SandboxProvider
from relay.providers.modal import ModalProvider
from relay.providers.sprites import SpritesProvider
from relay.providers.vercel import VercelProvider
from relay.settings import Settings

LIST_TIMEOUT_S = 0.5


def _settings(provider: str, **values: object) -> Settings:
    return Settings(_env_file=None, providers=[provider], cluster="test", **values)  # type: ignore[arg-type]


BUILDERS: dict[str, Callable[[str], SandboxProvider[Any]]] = {
    "e2b": lambda url: E2BProvider(
        _settings("e2b", e2b_api_key="k", e2b_api_url=url, e2b_sandbox_url=url)
    ),
    "daytona": lambda url: DaytonaProvider(
        _settings("daytona", daytona_api_key="k", daytona_api_url=f"{url}/api")
    ),
    "modal": lambda url: ModalProvider(
        _settings("modal", modal_token_id="id", modal_token_secret="secret", modal_server_url=url)
    ),
    "sprites": lambda url: SpritesProvider(
        _settings("sprites", sprites_token="k", sprites_base_url=url)
    ),
    "vercel": lambda url: VercelProvider(
        _settings(
            "vercel",
            vercel_token="k",
            vercel_team_id="team",
            vercel_project_id="project",
            vercel_base_url=url,
        )
    ),
}


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


@pytest.mark.parametrize("name", sorted(BUILDERS))
async def test_a_silent_provider_api_ends_the_listing_in_time(name: str, silent_url: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Daytona's polling-mode notice
        provider = BUILDERS[name](silent_url)
    provider.list_timeout_s = LIST_TIMEOUT_S
    started = time.monotonic()
    try:
        with pytest.raises(ProviderTimeout):
            await asyncio.wait_for(provider.list_owned(), 15)
    finally:
        await asyncio.wait_for(provider.aclose(), 15)
    assert time.monotonic() - started < LIST_TIMEOUT_S + 3
