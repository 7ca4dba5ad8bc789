"""The composition root (relay/runtime.py): a relay's parts built, started, and ended in
order, without the HTTP layer."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from relay.auth import Principal, new_token
from relay.providers.memory import MemoryProvider, MemoryWorld
from relay.run_state import RunState
from relay.runs.models import RunRequest
from relay.runtime import Relay
from tests.conftest import make_settings

PRINCIPAL = Principal(name="ops", command=True)


class Watched(MemoryProvider):
    """The in-memory provider, noting when its client is closed."""

    closed = False

    async def aclose(self) -> None:
        self.closed = True
        await super().aclose()


async def test_leaving_the_relay_drains_its_runs_before_closing_what_is_served_beside(
    tmp_path: Path,
) -> None:
    settings = make_settings(tmp_path, providers=["memory"], drain_s=0.0)
    new_token(settings.tokens_file, "ops")
    provider = Watched(settings, MemoryWorld())
    seen: list[tuple[RunState | None, bool, bool]] = []

    @contextlib.asynccontextmanager
    async def beside() -> AsyncIterator[None]:
        yield
        # Closed after the drain: the run is final; the store and the provider still open.
        found = await relay.store.get_run(run.id)
        seen.append((found.state if found else None, relay.service.accepting, provider.closed))

    async with Relay.open(settings, providers={"memory": provider}) as relay:
        await relay.start(beside())
        request = RunRequest(command=["sleep", "30"], wait=False)
        run, _ = await relay.service.submit(PRINCIPAL, request, None)
        assert (await relay.service.wait(run.id, 0.3)).state is RunState.running
    assert seen == [(RunState.canceled, False, False)]
    assert provider.closed
    assert relay.service.runner.stopped
