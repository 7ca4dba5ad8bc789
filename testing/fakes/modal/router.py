"""The fake's per-sandbox "task command router": execs as real subprocesses, their stdio, waits."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from grpclib import GRPCError, Status
from grpclib.server import Stream
from modal_proto import task_command_router_grpc
from modal_proto import task_command_router_pb2 as sr

from testing.fakes.modal import fs_tools
from testing.fakes.modal.state import BASE_ENV, FS_TOOLS, Exec, SandboxState
from testing.fakes.modal.unimplemented import unimplemented_mixin

if TYPE_CHECKING:
    from testing.fakes.modal.server import FakeModal

CHUNK = 64 * 1024
WAIT_CAP_S = 55.0
STDOUT = sr.TASK_EXEC_STDIO_FILE_DESCRIPTOR_STDOUT


class Router(
    unimplemented_mixin(task_command_router_grpc.TaskCommandRouterBase),  # type: ignore[misc]
    task_command_router_grpc.TaskCommandRouterBase,
):
    """Serves the exec RPCs of every fake sandbox (the real one runs on each worker)."""

    def __init__(self, fake: FakeModal) -> None:
        self.fake = fake

    def _task(self, stream: Stream[Any, Any], task_id: str) -> SandboxState:
        metadata: dict[str, Any] = dict(stream.metadata or {})
        authorization = metadata.get("authorization", "")
        if not str(authorization).startswith("Bearer "):
            raise GRPCError(Status.UNAUTHENTICATED, "fake: router wants a bearer token")
        sandbox = self.fake.tasks.get(task_id)
        if sandbox is None or sandbox.vanished:
            raise GRPCError(Status.NOT_FOUND, f"fake: no task {task_id}")
        return sandbox

    def _exec(self, stream: Stream[Any, Any], task_id: str, exec_id: str) -> Exec:
        sandbox = self._task(stream, task_id)
        found = sandbox.execs.get(exec_id)
        if found is None:
            raise GRPCError(Status.NOT_FOUND, f"fake: no exec {exec_id}")
        return found

    # -- start ------------------------------------------------------------------------------

    async def TaskExecStart(self, stream: Stream[Any, Any]) -> None:
        request = await stream.recv_message()
        sandbox = self._task(stream, request.task_id)
        if not sandbox.running:
            raise GRPCError(Status.FAILED_PRECONDITION, "fake: the sandbox has finished")
        if request.exec_id not in sandbox.execs:
            env: dict[str, str] = dict(sandbox.env)
            for source in request.secret_sources:
                env.update(source.env.contents)
            ex = Exec(exec_id=request.exec_id, argv=list(request.command_args))
            ex.cut_pending = self.fake.faults.cut_stream
            sandbox.execs[request.exec_id] = ex
            record = {
                "sandbox_id": sandbox.sandbox_id,
                "exec_id": ex.exec_id,
                "argv": list(ex.argv),
                "env": sorted(env),
                "workdir": request.workdir,
                "timeout_secs": request.timeout_secs,
                "pid": None,
            }
            self.fake.ledger.record_exec(record)
            workdir = request.workdir or sandbox.workdir
            if ex.argv and ex.argv[0] == FS_TOOLS:
                task = self._run_fs_tools(sandbox, ex)
            else:
                task = self._run_process(sandbox, ex, workdir, env, request.timeout_secs, record)
            self.fake.spawn(task)
        await stream.send_message(sr.TaskExecStartResponse())

    async def _run_process(
        self,
        sandbox: SandboxState,
        ex: Exec,
        workdir: str,
        env: dict[str, str],
        timeout: int,
        record: dict[str, Any],
    ) -> None:
        cwd = sandbox.host_path(workdir)
        full_env = {**BASE_ENV, "HOME": str(sandbox.root), **env}
        try:
            if not cwd.is_dir():
                raise FileNotFoundError(f"workdir {workdir} does not exist")
            ex.process = await asyncio.create_subprocess_exec(
                *ex.argv,
                cwd=cwd,
                env=full_env,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,  # its own process group, killed as a whole
            )
        except OSError as exc:
            await ex.stderr.append(f"fake exec failed: {exc}\n".encode())
            await ex.stdout.close()
            await ex.stderr.close()
            ex.code = 127
            ex.done.set()
            return
        process = ex.process
        record["pid"] = process.pid
        if not sandbox.running:  # terminated while we were starting it
            ex.kill()
        timer = asyncio.get_running_loop().call_later(timeout, ex.kill) if timeout else None
        assert process.stdout is not None and process.stderr is not None
        feeder = asyncio.ensure_future(self._feed_stdin(ex))
        try:
            await asyncio.gather(
                self._pump(process.stdout, ex.stdout),
                self._pump(process.stderr, ex.stderr),
                process.wait(),
            )
        finally:
            feeder.cancel()
            if timer is not None:
                timer.cancel()
            ex.kill()
        returncode = process.returncode if process.returncode is not None else -9
        if returncode < 0:
            ex.signal = -returncode
        else:
            ex.code = returncode
        ex.done.set()

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, output: Any) -> None:
        while chunk := await reader.read(CHUNK):
            await output.append(chunk)
        await output.close()

    @staticmethod
    async def _feed_stdin(ex: Exec) -> None:
        assert ex.process is not None and ex.process.stdin is not None
        writer = ex.process.stdin
        sent = 0
        try:
            while True:
                await ex.stdin_changed.wait()
                ex.stdin_changed.clear()
                if len(ex.stdin_buffer) > sent:
                    writer.write(bytes(ex.stdin_buffer[sent:]))
                    sent = len(ex.stdin_buffer)
                    await writer.drain()
                if ex.stdin_closed:
                    writer.close()
                    return
        except (BrokenPipeError, ConnectionResetError):
            return

    async def _run_fs_tools(self, sandbox: SandboxState, ex: Exec) -> None:
        """The client's filesystem helper: ``{"WriteFile": …}`` / ``{"MakeDirectory": …}``,
        and the reads of ``fs_tools.py`` (``{"ListFiles": …}`` / ``{"ReadFile": …}``)."""
        try:
            command = json.loads(ex.argv[1])
            if "WriteFile" in command:
                while not ex.stdin_closed:
                    await ex.stdin_changed.wait()
                    ex.stdin_changed.clear()
                target = sandbox.host_path(command["WriteFile"]["path"])
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(bytes(ex.stdin_buffer))
            elif "MakeDirectory" in command:
                target = sandbox.host_path(command["MakeDirectory"]["path"])
                target.mkdir(parents=command["MakeDirectory"].get("parents", True), exist_ok=True)
            elif "ListFiles" in command or "ReadFile" in command:
                failure = await fs_tools.answer(sandbox, command, ex.stdout)
                if failure is not None:
                    await ex.stderr.append(json.dumps(failure).encode())
                    ex.code = 1
                    await ex.stdout.close()
                    await ex.stderr.close()
                    ex.done.set()
                    return
            else:
                raise ValueError(f"unsupported fs-tools command {sorted(command)}")
            ex.code = 0
        except (OSError, ValueError, KeyError, IndexError) as exc:
            error = {"error_kind": "Other", "message": f"fake fs-tools: {type(exc).__name__}"}
            await ex.stderr.append(json.dumps(error).encode())
            ex.code = 1
        await ex.stdout.close()
        await ex.stderr.close()
        ex.done.set()

    # -- stdio ------------------------------------------------------------------------------

    async def TaskExecStdioRead(self, stream: Stream[Any, Any]) -> None:
        request = await stream.recv_message()
        ex = self._exec(stream, request.task_id, request.exec_id)
        output = ex.stdout if request.file_descriptor == STDOUT else ex.stderr
        offset = request.offset
        while True:
            await output.wait_beyond(offset)  # a real long poll: no answer until there is news
            if len(output.data) > offset:
                chunk = bytes(output.data[offset : offset + CHUNK])
                await stream.send_message(sr.TaskExecStdioReadResponse(data=chunk))
                offset += len(chunk)
                if ex.cut_pending and request.file_descriptor == STDOUT:
                    ex.cut_pending = False  # cut once: the client must resume from its offset
                    self.fake.ledger.stream_cuts += 1
                    raise GRPCError(Status.UNAVAILABLE, "fake: stream cut")
            elif output.closed:
                return

    async def TaskExecStdinWrite(self, stream: Stream[Any, Any]) -> None:
        request = await stream.recv_message()
        ex = self._exec(stream, request.task_id, request.exec_id)
        self._write_stdin(ex, request.offset, request.data, request.eof)
        await stream.send_message(sr.TaskExecStdinWriteResponse())

    async def TaskExecStdinWriteStream(self, stream: Stream[Any, Any]) -> None:
        first = await stream.recv_message()
        if first is None or not first.HasField("start"):
            raise GRPCError(Status.INVALID_ARGUMENT, "fake: a stdin stream opens with start")
        ex = self._exec(stream, first.start.task_id, first.start.exec_id)
        offset = first.start.offset
        async for message in stream:
            if message.HasField("end"):
                self._write_stdin(ex, offset, b"", True)
                break
            self._write_stdin(ex, offset, message.data, False)
            offset += len(message.data)
        await stream.send_message(sr.TaskExecStdinWriteStreamResponse())

    async def TaskExecStdinStatus(self, stream: Stream[Any, Any]) -> None:
        request = await stream.recv_message()
        ex = self._exec(stream, request.task_id, request.exec_id)
        await stream.send_message(
            sr.TaskExecStdinStatusResponse(
                num_bytes_written=len(ex.stdin_buffer), closed=ex.stdin_closed
            )
        )

    @staticmethod
    def _write_stdin(ex: Exec, offset: int, data: bytes, eof: bool) -> None:
        if ex.stdin_closed:
            return
        end = offset + len(data)
        if end > len(ex.stdin_buffer):  # a retried write only adds what is new
            ex.stdin_buffer.extend(data[len(ex.stdin_buffer) - offset :])
        ex.stdin_closed = eof
        ex.stdin_changed.set()

    # -- exit -------------------------------------------------------------------------------

    @staticmethod
    def _exit_status(ex: Exec, response: Any) -> Any:
        if ex.signal is not None:
            return response(signal=ex.signal)
        if ex.code is not None:
            return response(code=ex.code)
        return response()

    async def TaskExecWait(self, stream: Stream[Any, Any]) -> None:
        request = await stream.recv_message()
        ex = self._exec(stream, request.task_id, request.exec_id)
        try:
            await asyncio.wait_for(ex.done.wait(), WAIT_CAP_S)
        except TimeoutError as exc:
            raise GRPCError(Status.DEADLINE_EXCEEDED, "fake: still running") from exc
        self._exec(stream, request.task_id, request.exec_id)  # the sandbox may have vanished
        await stream.send_message(self._exit_status(ex, sr.TaskExecWaitResponse))

    async def TaskExecPoll(self, stream: Stream[Any, Any]) -> None:
        request = await stream.recv_message()
        ex = self._exec(stream, request.task_id, request.exec_id)
        await stream.send_message(self._exit_status(ex, sr.TaskExecPollResponse))
