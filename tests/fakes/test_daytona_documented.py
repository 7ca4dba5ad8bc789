"""The Daytona fake answers as Daytona documents (shared/reference/daytona.md, daytona
0.226.1): a list item is the sandbox DTO without ``env`` and ``kvm``, unknown ids are 404 with
the documented error body, and a command's environment is the sandbox's on top of its own.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from relay.providers.base import OutputSink, SandboxSpec
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
    provider = DaytonaProvider(settings_for(fake))
    spec = SandboxSpec("run_doc_env", "doc", timeout_s=20, env={"FROM_CREATE": "a"})
    try:
        async with provider.sandbox(spec) as box:
            sink = OutputSink(1000)
            await box.exec(
                ["sh", "-c", 'echo "$FROM_CREATE $HOME"; test -n "$PATH" && echo path'],
                stdin=None,
                env={"FROM_CREATE": "a"},
                workdir=None,
                timeout_s=10,
                output=sink,
            )
    finally:
        await provider.aclose()
    assert sink.text("stdout") == "a /home/daytona\npath\n", sink.text("stderr")
