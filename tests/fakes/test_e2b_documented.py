"""The E2B fake answers as E2B documents (shared/reference/e2b.md; E2B's public OpenAPI spec):
a listed sandbox's fields, the list's page bounds, unknown ids, and a command's env.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from e2b import AsyncSandbox

from testing.fakes.e2b import FakeE2B, running_fake

REQUIRED = {"templateID", "sandboxID", "clientID", "startedAt", "endAt", "cpuCount", "memoryMB"}
REQUIRED |= {"diskSizeMB", "state", "envdVersion"}
OPTIONAL = {"alias", "metadata", "envdUnresponsiveAtPause", "volumeMounts"}
"""ListedSandbox in E2B's OpenAPI spec: what a listed sandbox must carry, and may."""


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeE2B]:
    with running_fake() as server:
        yield server


@pytest.fixture
def api(fake: FakeE2B) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fake.url, headers={"X-API-Key": "k"}) as client:
        yield client


def test_a_listed_sandbox_has_the_documented_fields_and_pages_hold_1_to_100(
    api: httpx.Client,
) -> None:
    created = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 30})
    assert created.status_code == 201
    sandbox_id = created.json()["sandboxID"]
    try:
        [item] = [i for i in api.get("/v2/sandboxes").json() if i["sandboxID"] == sandbox_id]
        assert REQUIRED <= set(item) <= REQUIRED | OPTIONAL
        for limit in ("0", "101", "x"):
            refused = api.get("/v2/sandboxes", params={"limit": limit})
            assert refused.status_code == 400 and set(refused.json()) == {"code", "message"}
        for limit in ("1", "100"):
            assert api.get("/v2/sandboxes", params={"limit": limit}).status_code == 200
    finally:
        assert api.delete(f"/sandboxes/{sandbox_id}").status_code == 204


def test_an_unknown_sandbox_is_404(api: httpx.Client) -> None:
    assert api.delete("/sandboxes/sb-none").status_code == 404
    answer = api.post("/sandboxes/sb-none/timeout", json={"timeout": 10})
    assert answer.status_code == 404 and set(answer.json()) == {"code", "message"}


async def test_a_commands_env_is_added_to_the_sandboxes(fake: FakeE2B) -> None:
    """Driven by the SDK alone: the relay sends a job's env with its command only, so only
    the SDK's own create gives a sandbox env of its own."""
    sandbox = await AsyncSandbox.create(
        template="base",
        timeout=20,
        envs={"FROM_CREATE": "a"},
        api_key="test-key",
        api_url=fake.url,
        sandbox_url=fake.url,
        debug=False,
    )
    try:
        done = await sandbox.commands.run(
            'echo "$FROM_CREATE $FROM_EXEC"; test -n "$PATH" && echo path',
            envs={"FROM_EXEC": "b"},
        )
    finally:
        await sandbox.kill()
    assert done.stdout == "a b\npath\n", done.stderr


async def test_files_list_and_read_as_the_sdk_reads_them(fake: FakeE2B) -> None:
    """envd's ListDir and GET /files, through the SDK's own files.list and files.read: a link
    is SYMLINK (the newer envd's is_symlink), a FIFO is left out (FILE_TYPE_UNSPECIFIED), a
    file streams its bytes, a missing one is FileNotFoundException."""
    from e2b import FileType
    from e2b.exceptions import FileNotFoundException

    sandbox = await AsyncSandbox.create(
        template="base", timeout=20, api_key="test-key", api_url=fake.url,
        sandbox_url=fake.url, debug=False,
    )  # fmt: skip
    try:
        await sandbox.commands.run(
            "mkdir -p /workspace/d/sub && printf abc > /workspace/d/f.txt && "
            "ln -s f.txt /workspace/d/link && mkfifo /workspace/d/pipe",
            user="root",
        )
        listed = {entry.name: entry for entry in await sandbox.files.list("/workspace/d")}
        stream = await sandbox.files.read("/workspace/d/f.txt", format="stream")
        read = b"".join([chunk async for chunk in stream])
        with pytest.raises(FileNotFoundException):
            await sandbox.files.list("/workspace/nowhere")
        with pytest.raises(FileNotFoundException):
            await sandbox.files.read("/workspace/d/none.txt", format="bytes")
    finally:
        await sandbox.kill()
    assert {name: entry.type for name, entry in listed.items()} == {
        "sub": FileType.DIR, "f.txt": FileType.FILE, "link": FileType.SYMLINK,
    }  # fmt: skip
    assert listed["f.txt"].size == 3 and read == b"abc"
