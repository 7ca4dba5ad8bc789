"""The Modal fake answers as Modal's API does for the ``modal`` client (shared/reference/modal.md,
modal 1.6.4; the ``modal_proto`` messages are the API's schema): the list's pages and their
end, unknown sandboxes, and an exec's env, asked over raw gRPC where the client would hide it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import modal
import pytest
from grpclib import GRPCError, Status
from grpclib.client import Channel
from modal_proto import api_grpc, api_pb2

from testing.fakes.modal import FakeModal, running_fake
from testing.fakes.modal.control import LIST_PAGE
from testing.fakes.modal.state import SandboxState

METADATA = {"x-modal-token-id": "ak-doc", "x-modal-token-secret": "as-doc"}


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeModal]:
    with running_fake() as server:
        yield server


def stub_for(fake: FakeModal, channel_holder: list[Channel]) -> Any:
    host, port = fake.url.removeprefix("http://").split(":")
    channel = Channel(host, int(port))
    channel_holder.append(channel)
    return api_grpc.ModalClientStub(channel)


async def test_the_list_pages_back_in_time_and_ends_with_an_empty_page(
    fake: FakeModal, tmp_path: Path
) -> None:
    now = time.time()
    for n in range(LIST_PAGE + 3):  # more than one page, straight into the fake's state
        sandbox_id = f"sb-doc-{n:03d}"
        fake.sandboxes[sandbox_id] = SandboxState(
            sandbox_id, f"ta-doc-{n}", "ap-doc", {"relay-cluster": "doc"}, {}, 60,
            now - n, tmp_path, "/",
        )  # fmt: skip
    channels: list[Channel] = []
    stub = stub_for(fake, channels)
    seen: list[str] = []
    before = 0.0
    try:
        while True:
            request = api_pb2.SandboxListRequest(app_id="ap-doc", before_timestamp=before)
            page = await stub.SandboxListV2(request, metadata=METADATA)
            if not page.sandboxes:
                break
            assert len(page.sandboxes) <= LIST_PAGE
            seen += [info.id for info in page.sandboxes]
            before = min(info.created_at for info in page.sandboxes)
    finally:
        for channel in channels:
            channel.close()
        for n in range(LIST_PAGE + 3):
            fake.sandboxes.pop(f"sb-doc-{n:03d}", None)
    assert seen == [f"sb-doc-{n:03d}" for n in range(LIST_PAGE + 3)]


async def test_an_unknown_sandbox_is_not_found(fake: FakeModal) -> None:
    channels: list[Channel] = []
    stub = stub_for(fake, channels)
    try:
        with pytest.raises(GRPCError) as raised:
            request = api_pb2.SandboxTerminateRequest(sandbox_id="sb-none")
            await stub.SandboxTerminateV2(request, metadata=METADATA)
    finally:
        for channel in channels:
            channel.close()
    assert raised.value.status == Status.NOT_FOUND


async def test_an_execs_env_is_added_to_the_sandboxes(fake: FakeModal) -> None:
    """Driven by the client alone: the relay gives a sandbox no env of a job's (it travels
    with the exec), so only the client's own create makes one with ``env``."""
    client: Any = modal.Client(fake.url, api_pb2.CLIENT_TYPE_CLIENT, ("ak-doc", "as-doc"))
    await client.__aenter__()
    try:
        app = await modal.App.lookup.aio("relay-doc", client=client, create_if_missing=True)
        sandbox: Any = await modal.Sandbox.create.aio(
            app=app, client=client, timeout=20, env={"FROM_CREATE": "a"}
        )
        try:
            process = await sandbox.exec.aio(
                "sh",
                "-c",
                'echo "$FROM_CREATE $FROM_EXEC"; test -n "$PATH" && echo path',
                env={"FROM_EXEC": "b"},
            )
            stdout = await process.stdout.read.aio()
            stderr = await process.stderr.read.aio()
            await process.wait.aio()
        finally:
            await sandbox.terminate.aio()
            await sandbox.detach.aio()  # its router connection
    finally:
        await client.close.aio()
    assert stdout == "a b\npath\n", stderr
