"""The fake's control plane: the ``ModalClient`` RPCs a sandbox run makes."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from typing import TYPE_CHECKING, Any

from google.protobuf import empty_pb2
from grpclib import GRPCError, Status
from grpclib.server import Stream
from modal_proto import api_grpc, api_pb2

from testing.fakes.modal.state import SandboxState, new_root
from testing.fakes.modal.unimplemented import unimplemented_mixin

if TYPE_CHECKING:
    from testing.fakes.modal.server import FakeModal

OK = api_pb2.GenericResult
CREATE_STATUS = {
    401: Status.UNAUTHENTICATED,
    403: Status.PERMISSION_DENIED,
    429: Status.RESOURCE_EXHAUSTED,
    500: Status.UNAVAILABLE,
    502: Status.UNAVAILABLE,
    503: Status.UNAVAILABLE,
}
"""How an HTTP-style fault status is answered over gRPC."""
BUILDER_VERSION = "2025.06"
LIST_PAGE = 50
WAIT_CAP_S = 55.0


def _short_id(prefix: str, seed: str, length: int = 22) -> str:
    digest = hashlib.sha256(seed.encode()).hexdigest()
    return prefix + "".join(c for c in digest if c.isalnum())[:length]


class ControlPlane(unimplemented_mixin(api_grpc.ModalClientBase), api_grpc.ModalClientBase):  # type: ignore[misc]
    """Serves ``modal.client`` calls: apps, images, tokens and the ``Sandbox*V2`` family."""

    def __init__(self, fake: FakeModal) -> None:
        self.fake = fake

    # -- helpers -------------------------------------------------------------------------

    def _authorize(self, stream: Stream[Any, Any]) -> None:
        metadata: dict[str, Any] = dict(stream.metadata or {})
        token_id = metadata.get("x-modal-token-id")
        token_secret = metadata.get("x-modal-token-secret")
        if not token_id or not token_secret or "bad-key" in (token_id, token_secret):
            raise GRPCError(Status.UNAUTHENTICATED, "fake: invalid token")

    def _sandbox(self, sandbox_id: str) -> SandboxState:
        sandbox = self.fake.sandboxes.get(sandbox_id)
        if sandbox is None or sandbox.vanished:
            raise GRPCError(Status.NOT_FOUND, f"fake: no sandbox {sandbox_id}")
        return sandbox

    @staticmethod
    def _result(sandbox: SandboxState) -> api_pb2.GenericResult:
        if sandbox.result is None:
            return api_pb2.GenericResult()
        status, exitcode = sandbox.result
        return api_pb2.GenericResult(status=status, exitcode=exitcode)  # type: ignore[arg-type]

    # -- apps, environments, images, tokens ----------------------------------------------

    async def ClientHello(self, stream: Stream[empty_pb2.Empty, Any]) -> None:
        await stream.recv_message()
        self._authorize(stream)
        await stream.send_message(api_pb2.ClientHelloResponse())

    async def AppGetOrCreate(self, stream: Stream[Any, Any]) -> None:
        request = await stream.recv_message()
        self._authorize(stream)
        app_id = _short_id("ap-", f"{request.environment_name}/{request.app_name}")
        self.fake.apps[app_id] = request.app_name
        await stream.send_message(api_pb2.AppGetOrCreateResponse(app_id=app_id))

    async def EnvironmentGetOrCreate(self, stream: Stream[Any, Any]) -> None:
        request = await stream.recv_message()
        self._authorize(stream)
        settings = api_pb2.EnvironmentSettings(image_builder_version=BUILDER_VERSION)
        name = request.deployment_name or "main"
        await stream.send_message(
            api_pb2.EnvironmentGetOrCreateResponse(
                environment_id=_short_id("en-", name),
                metadata=api_pb2.EnvironmentMetadata(name=name, settings=settings),
            )
        )

    async def ImageGetOrCreate(self, stream: Stream[Any, Any]) -> None:
        request = await stream.recv_message()
        self._authorize(stream)
        image = request.image
        image_id = _short_id("im-", image.SerializeToString(deterministic=True).hex())
        self.fake.images[image_id] = {
            "base": [base.docker_tag or base.image_id for base in image.base_images],
            "commands": list(image.dockerfile_commands),
        }
        await stream.send_message(
            api_pb2.ImageGetOrCreateResponse(
                image_id=image_id,
                result=api_pb2.GenericResult(status=OK.GENERIC_STATUS_SUCCESS),
                metadata=api_pb2.ImageMetadata(image_builder_version=BUILDER_VERSION),
            )
        )

    async def AuthTokenGet(self, stream: Stream[Any, Any]) -> None:
        await stream.recv_message()
        self._authorize(stream)
        await stream.send_message(api_pb2.AuthTokenGetResponse(token=self.fake.jwt()))

    # -- sandboxes ------------------------------------------------------------------------

    async def SandboxCreateV2(self, stream: Stream[Any, Any]) -> None:
        request = await stream.recv_message()
        self._authorize(stream)
        faults = self.fake.faults
        if faults.create_hang:
            await asyncio.Event().wait()  # until the client gives up and resets the stream
        if faults.create_status is not None:
            status = CREATE_STATUS.get(faults.create_status, Status.INTERNAL)
            raise GRPCError(status, f"fake: create answers {faults.create_status}")
        key = str(dict(stream.metadata or {}).get("x-idempotency-key") or "")
        sandbox = self.fake.sandboxes.get(self.fake.create_keys.get(key, ""))
        if sandbox is None:
            sandbox = self._allocate(request)
            if key:
                self.fake.create_keys[key] = sandbox.sandbox_id
        if faults.create_allocates_then_fails:
            raise GRPCError(Status.UNAVAILABLE, "fake: allocated, then the answer was lost")
        await stream.send_message(
            api_pb2.SandboxCreateV2Response(
                sandbox_id=sandbox.sandbox_id,
                task_id=sandbox.task_id,
                metadata=api_pb2.SandboxHandleMetadata(app_id=sandbox.app_id),
                command_router_access=api_pb2.CommandRouterAccess(
                    url=self.fake.url, jwt=self.fake.jwt()
                ),
            )
        )

    def _allocate(self, request: api_pb2.SandboxCreateV2Request) -> SandboxState:
        fake = self.fake
        definition = request.definition
        seq = next(fake.counter)
        sandbox_id = _short_id("sb-", f"{time.time_ns()}/{seq}", 24)
        env: dict[str, str] = {}
        for source in request.secret_sources:
            env.update(source.env.contents)
        sandbox = SandboxState(
            sandbox_id=sandbox_id,
            task_id=_short_id("ta-", sandbox_id, 20) + "V",
            app_id=request.app_id,
            tags={tag.tag_name: tag.tag_value for tag in request.tags},
            env=env,
            timeout_secs=definition.timeout_secs,
            created_at=time.time(),
            root=new_root(fake.root),
            workdir=definition.workdir or "/",
        )
        fake.sandboxes[sandbox_id] = sandbox
        fake.tasks[sandbox.task_id] = sandbox
        network = definition.network_access
        fake.ledger.record_create(
            {
                "sandbox_id": sandbox_id,
                "app_id": request.app_id,
                "lifetime": definition.timeout_secs,
                "tags": dict(sandbox.tags),
                "network": {
                    "type": api_pb2.NetworkAccess.NetworkAccessType.Name(
                        network.network_access_type
                    ),
                    "cidrs": list(network.allowed_cidrs),
                    "domains": list(network.allowed_domains),
                },
                "resources": {
                    "milli_cpu": definition.resources.milli_cpu,
                    "memory_mb": definition.resources.memory_mb,
                },
                "image_id": definition.image_id,
                "image": fake.images.get(definition.image_id),
                "env": sorted(env),
                "entrypoint": list(definition.entrypoint_args),
                "workdir": definition.workdir,
            }
        )
        loop = asyncio.get_running_loop()
        sandbox.timers.append(loop.call_later(sandbox.timeout_secs, fake.expire, sandbox))
        if fake.faults.vanish_after_s is not None:
            sandbox.timers.append(loop.call_later(fake.faults.vanish_after_s, fake.vanish, sandbox))
        return sandbox

    async def SandboxWaitV2(self, stream: Stream[Any, Any]) -> None:
        request = await stream.recv_message()
        self._authorize(stream)
        sandbox = self._sandbox(request.sandbox_id)
        if request.timeout > 0 and sandbox.running:
            # a real long poll: hold the call until the sandbox ends or time is up
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(sandbox.finished.wait(), min(request.timeout, WAIT_CAP_S))
        self._sandbox(request.sandbox_id)  # it may have vanished meanwhile
        await stream.send_message(
            api_pb2.SandboxWaitResponse(
                result=self._result(sandbox),
                metadata=api_pb2.SandboxHandleMetadata(app_id=sandbox.app_id),
            )
        )

    async def SandboxTerminateV2(self, stream: Stream[Any, Any]) -> None:
        request = await stream.recv_message()
        self._authorize(stream)
        faults = self.fake.faults
        if faults.terminate_failures > 0:
            faults.terminate_failures -= 1
            raise GRPCError(Status.UNAVAILABLE, "fake: terminate failed")
        sandbox = self._sandbox(request.sandbox_id)
        existing = self._result(sandbox)
        self.fake.terminate(sandbox)
        await stream.send_message(api_pb2.SandboxTerminateResponse(existing_result=existing))

    async def SandboxListV2(self, stream: Stream[Any, Any]) -> None:
        request = await stream.recv_message()
        self._authorize(stream)
        wanted = {tag.tag_name: tag.tag_value for tag in request.tags}
        before = request.before_timestamp or float("inf")
        found = [
            sb
            for sb in self.fake.sandboxes.values()
            if not sb.vanished
            and (request.include_finished or sb.running)
            and (not request.app_id or sb.app_id == request.app_id)
            and all(sb.tags.get(name) == value for name, value in wanted.items())
            and sb.created_at < before
        ]
        found.sort(key=lambda sb: sb.created_at, reverse=True)
        infos = [
            api_pb2.SandboxInfo(
                id=sb.sandbox_id,
                created_at=sb.created_at,
                app_id=sb.app_id,
                tags=[api_pb2.SandboxTag(tag_name=k, tag_value=v) for k, v in sb.tags.items()],
                timeout_secs=sb.timeout_secs,
                task_info=api_pb2.TaskInfo(id=sb.task_id, result=self._result(sb)),
                metadata=api_pb2.SandboxHandleMetadata(app_id=sb.app_id),
            )
            for sb in found[:LIST_PAGE]
        ]
        await stream.send_message(api_pb2.SandboxListResponse(sandboxes=infos))

    async def SandboxGetTaskIdV2(self, stream: Stream[Any, Any]) -> None:
        request = await stream.recv_message()
        self._authorize(stream)
        sandbox = self._sandbox(request.sandbox_id)
        if sandbox.running:
            answer = api_pb2.SandboxGetTaskIdResponse(task_id=sandbox.task_id)
        else:
            answer = api_pb2.SandboxGetTaskIdResponse(task_result=self._result(sandbox))
        await stream.send_message(answer)

    async def SandboxGetCommandRouterAccess(self, stream: Stream[Any, Any]) -> None:
        request = await stream.recv_message()
        self._authorize(stream)
        if request.sandbox_id:
            self._sandbox(request.sandbox_id)
        await stream.send_message(
            api_pb2.SandboxGetCommandRouterAccessResponse(url=self.fake.url, jwt=self.fake.jwt())
        )

    async def SandboxTagsGetV2(self, stream: Stream[Any, Any]) -> None:
        request = await stream.recv_message()
        self._authorize(stream)
        sandbox = self._sandbox(request.sandbox_id)
        tags = [api_pb2.SandboxTag(tag_name=k, tag_value=v) for k, v in sandbox.tags.items()]
        await stream.send_message(api_pb2.SandboxTagsGetResponse(tags=tags))

    async def SandboxTagsSetV2(self, stream: Stream[Any, Any]) -> None:
        request = await stream.recv_message()
        self._authorize(stream)
        sandbox = self._sandbox(request.sandbox_id)
        sandbox.tags = {tag.tag_name: tag.tag_value for tag in request.tags}
        await stream.send_message(empty_pb2.Empty())
