"""The Vercel fake answers as Vercel Sandbox documents (shared/reference/vercel.md; the
``vercel-sandbox`` 0.10.0 API models): the list's shape, unknown names, and a command's env.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from vercel.sandbox import SandboxClient, SandboxCredentials, SandboxServiceOptions

from relay.providers.contract import SandboxSpec
from relay.providers.vercel import VercelProvider
from testing.fakes.vercel import FakeVercel, running_fake
from testing.rigs.vercel import PROJECT, TEAM, TOKEN, settings_for


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeVercel]:
    with running_fake() as server:
        yield server


@pytest.fixture
def api(fake: FakeVercel) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=fake.url, headers=headers, params={"teamId": TEAM}) as client:
        yield client


async def test_the_list_is_sandboxes_and_pagination(fake: FakeVercel, api: httpx.Client) -> None:
    provider = VercelProvider(settings_for(fake))
    try:
        async with provider.sandbox(SandboxSpec("run_doc", "test", timeout_s=20)) as box:
            page = api.get("/v2/sandboxes", params={"project": PROJECT}).json()
    finally:
        await provider.aclose()
    assert set(page) == {"sandboxes", "pagination"}
    assert set(page["pagination"]) == {"count", "next", "prev"}
    [item] = [item for item in page["sandboxes"] if item["name"] == box.id]
    assert {"name", "currentSessionId", "status"} <= set(item)


def test_an_unknown_sandbox_is_404(api: httpx.Client) -> None:
    assert api.get("/v2/sandboxes/none").status_code == 404
    assert api.delete("/v2/sandboxes/none", params={"projectId": PROJECT}).status_code == 404


async def test_a_commands_env_is_added_to_the_sandboxes(fake: FakeVercel) -> None:
    """Driven by the SDK alone: the relay gives a sandbox no env of a job's (it travels with
    the command), so only the SDK's own create makes one with ``env``."""

    async def credentials() -> SandboxCredentials:
        return SandboxCredentials(TOKEN, TEAM, PROJECT)

    options = SandboxServiceOptions(base_url=fake.url, credentials_factory=credentials)
    client = SandboxClient.create(options=options)
    try:
        box = await client.create_sandbox(
            name="doc-env", env={"FROM_CREATE": "a"}, persistent=False, execution_time_limit=20
        )
        try:
            done = await box.run_process(
                "sh",
                ["-c", 'echo "$FROM_CREATE $FROM_EXEC"; test -n "$PATH" && echo path'],
                env={"FROM_EXEC": "b"},
                capture_output=True,
            )
        finally:
            await box.destroy(delete_orphan_snapshots=True)
    finally:
        await client.aclose()
    assert done.stdout == "a b\npath\n", done.stderr
