"""The Daytona fake answers as Daytona documents (shared/reference/daytona.md, daytona
0.226.1): a list item is the sandbox DTO without ``env`` and ``kvm``, unknown ids are 404 with
the documented error body, and a command's environment is the sandbox's on top of its own.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator

import httpx
import pytest
from daytona import (
    AsyncDaytona,
    CreateSandboxFromSnapshotParams,
    DaytonaConfig,
    SessionExecuteRequest,
)

from relay.providers.contract import SandboxSpec
from relay.providers.daytona import DaytonaProvider
from testing.fakes.daytona import FakeDaytona, running_fake
from testing.rigs.daytona import KEY, settings_for

DTO_REQUIRED = {"id", "organizationId", "name", "user", "env", "labels", "public"}
DTO_REQUIRED |= {"networkBlockAll", "kvm", "target", "cpu", "gpu", "memory", "disk"}
DTO_REQUIRED |= {"toolboxProxyUrl"}


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeDaytona]:
    with running_fake() as server:
        yield server


@pytest.fixture
def api(fake: FakeDaytona) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=fake.api_url, headers=headers) as client:
        yield client


async def test_a_list_item_is_the_dto_without_env_and_kvm(
    fake: FakeDaytona, api: httpx.Client
) -> None:
    provider = DaytonaProvider(settings_for(fake))
    try:
        async with provider.sandbox(SandboxSpec("run_doc", "doc", timeout_s=20)) as box:
            full = api.get(f"/sandbox/{box.id}").json()
            query = {"labels": json.dumps({"relay-cluster": "doc"}), "limit": "1"}
            page = api.get("/sandbox", params=query).json()
    finally:
        await provider.aclose()
    assert set(full) >= DTO_REQUIRED
    assert set(page) == {"items", "nextCursor"}
    [item] = page["items"]
    assert set(item) == set(full) - {"env", "kvm"}


def test_an_unknown_sandbox_is_404_with_the_documented_body(api: httpx.Client) -> None:
    for answer in (api.get("/sandbox/none"), api.delete("/sandbox/none")):
        assert answer.status_code == 404
        assert {"statusCode", "message", "code", "source"} <= set(answer.json())


async def test_a_commands_env_is_the_sandboxes_on_its_default(fake: FakeDaytona) -> None:
    """Driven by the SDK alone: the relay gives a sandbox no env of a job's (it travels with
    the command), so only the SDK's own create makes one with ``env_vars``."""
    config = DaytonaConfig(
        api_key=KEY,
        api_url=fake.api_url,
        target="us",
        use_deprecated_polling=True,
        otel_enabled=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the polling mode's
        client = AsyncDaytona(config)
    stdout: list[str] = []
    stderr: list[str] = []
    try:
        params = CreateSandboxFromSnapshotParams(env_vars={"FROM_CREATE": "a"}, ephemeral=True)
        box = await client.create(params)
        try:
            await box.process.create_session("doc")
            command = 'echo "$FROM_CREATE $HOME"; test -n "$PATH" && echo path'
            started = await box.process.execute_session_command(
                "doc", SessionExecuteRequest(command=command, run_async=True)
            )
            await box.process.get_session_command_logs_async(
                "doc", str(started.cmd_id), stdout.append, stderr.append
            )
        finally:
            await box.delete()
    finally:
        await client.close()  # type: ignore[no-untyped-call]
    assert "".join(stdout) == "a /home/daytona\npath\n", stderr
