"""The fake Worker's state: its jobs, each a real process in a private directory.

A job's container is a host directory standing in for ``/`` (``/workspace`` and ``/tmp``
in it); its command is a real process run there the way the other fakes run one
(:mod:`testing.fakes.vercel.jail`: bubblewrap when it works here, with a private network
when the job's egress is ``[]``; allow-lists are recorded, not enforced). As the Worker
does: a one-shot job (its command in the create) runs at once and its container is
destroyed when the command ends; a two-step job's container is made ``ready`` and waits for
its one run, and outlives its command until a DELETE or the alarm. The command is killed at
its ``timeout_s`` (SIGTERM, SIGKILL 5 s later, exit 124 and "Command timed out"), and the
alarm destroys the container at ``created + timeout_s + grace_s`` whatever happens; a
destroy that fails is retried every :attr:`World.destroy_retry_s`. Everything runs on the
fake's event loop; the ledger is also read from other threads.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import contextlib
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from testing.fakes.cloudflare.contract import INSTANCE_TYPES
from testing.fakes.cloudflare.job import FakeJob
from testing.fakes.cloudflare.ledger import Faults, Ledger
from testing.fakes.vercel.jail import host_path, launch, prepare_root

WORKSPACE = "/workspace"
INSTANCE_TYPE_NAMES = tuple(name for name, *_ in INSTANCE_TYPES)
KILL_AFTER_S = 5.0
"""The SDK's SIGTERM-to-SIGKILL wait when a command times out."""


class World:
    """Every job the fake Worker knows, by id."""

    def __init__(
        self, output_limit_bytes: int = 1_048_576, deployed: tuple[str, ...] = INSTANCE_TYPE_NAMES
    ) -> None:
        self.ledger = Ledger()
        self.faults = Faults()
        self.hang = asyncio.Event()
        self.jobs: dict[str, FakeJob] = {}
        self.base_dir = Path(tempfile.mkdtemp(prefix="fake-cloudflare-"))
        self.output_limit_bytes = output_limit_bytes
        self.deployed = deployed
        """The instance types the Worker was deployed with (a size only others hold: 422)."""
        self.destroy_retry_s = 30.0
        self.heartbeat_s = 15.0

    # --- creating and running ------------------------------------------------------------

    def create(
        self,
        body: dict[str, Any],
        digest: str,
        instance_type: str,
        egress: tuple[str, list[str]],
        command: dict[str, Any] | None,
    ) -> FakeJob:
        """Record the job, list it, arm its alarm, and start its container (and a one-shot
        job's command)."""
        now = time.time()
        job = FakeJob(
            body=body,
            digest=digest,
            command=command,
            keep=command is None,
            instance_type=instance_type,
            egress=egress,
            root=self.base_dir / body["id"],
            created_at=now,
            deadline=now + body["timeout_s"] + body["grace_s"],
        )
        self.jobs[job.id] = job
        self.ledger.record_create(
            {
                "id": job.id,
                "tags": dict(body["tags"]),
                "instance_type": instance_type,
                "egress": list(body["egress"]),
                "timeout_s": body["timeout_s"],
                "grace_s": body["grace_s"],
                "created_at": now,
                "command": command is not None,
            }
        )
        loop = asyncio.get_running_loop()
        job.timers.append(loop.call_later(job.deadline - now, self.alarm, job.id))
        if self.faults.vanish_after_s is not None:
            job.timers.append(loop.call_later(self.faults.vanish_after_s, self.vanish, job.id))
        job.tasks.append(asyncio.create_task(self._begin(job)))
        return job

    async def run(self, job: FakeJob, command: dict[str, Any], digest: str) -> str:
        """A two-step job's command: ``started``, ``existing`` (the same run again),
        ``already_run`` (it has another) or ``ended`` (it ended before any command)."""
        await job.started.wait()
        if job.command is not None:
            return "existing" if job.run_digest == digest else "already_run"
        if job.state != "ready":
            return "ended"
        job.command, job.run_digest = command, digest
        job.state, job.started_at = "running", time.time()
        job.changed.fire()
        job.tasks.append(asyncio.create_task(self._command(job)))
        return "started"

    async def _begin(self, job: FakeJob) -> None:
        """Start the container; then a one-shot job's command."""
        try:
            for directory in (WORKSPACE, "/tmp"):
                (job.root / directory.lstrip("/")).mkdir(parents=True, exist_ok=True)
            prepare_root(job.root)
        except OSError as exc:
            self.end(job, "error", None, {"code": "start_failed", "message": type(exc).__name__})
            self.destroy(job.id, "exit")
            return
        finally:
            if job.keep and not job.final and job.destroyed_at is None:
                job.state = "ready"
                job.changed.fire()
            job.started.set()
        if job.final:  # ended (canceled, lost) while it started
            self.destroy(job.id, "exit")
        elif not job.keep:
            job.state, job.started_at = "running", time.time()
            await self._command(job)

    async def _command(self, job: FakeJob) -> None:
        """Write the command's files, run it to its end; destroy a one-shot job's container."""
        command = job.command
        assert command is not None
        try:
            for path, content in command["files"].items():
                target = host_path(job.root, f"{WORKSPACE}/{path}")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(base64.b64decode(content))
            cwd = WORKSPACE if command["workdir"] is None else f"{WORKSPACE}/{command['workdir']}"
            host_path(job.root, cwd).mkdir(parents=True, exist_ok=True)
            how = launch(
                job.root,
                ["sh", "-c", 'exec "$@"', "sh", *command["argv"]],
                cwd,
                isolate_network=job.egress[0] == "none",
            )
            environment = {
                "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "HOME": WORKSPACE if how.cwd is None else str(host_path(job.root, WORKSPACE)),
                "LANG": "C.UTF-8",
                **command["env"],
            }
            with self.ledger.lock:
                self.ledger.commands.append(
                    {
                        "id": job.id,
                        "argv": command["argv"],
                        "cwd": cwd,
                        "env_names": sorted(command["env"]),
                    }
                )
            if job.final:
                return
            job.process = await asyncio.create_subprocess_exec(
                *how.argv,
                cwd=how.cwd,
                env=environment,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
        except (OSError, ValueError) as exc:
            self.end(job, "error", None, {"code": "run_failed", "message": type(exc).__name__})
            self._after_command(job)
            return
        if job.final:  # ended (canceled, lost) while the process was starting
            job.kill()
            await job.process.wait()
            self._after_command(job)
            return
        job.changed.fire()
        await self._follow(job)
        self._after_command(job)

    def _after_command(self, job: FakeJob) -> None:
        """A one-shot job's container goes with its command; a two-step job's waits."""
        if not job.keep:
            self.destroy(job.id, "exit")

    async def _follow(self, job: FakeJob) -> None:
        process = job.process
        assert process is not None and process.stdin is not None
        assert job.command is not None
        stdin = job.command["stdin"]
        with contextlib.suppress(ConnectionError):
            if stdin is not None:
                process.stdin.write(base64.b64decode(stdin))
                await process.stdin.drain()
            process.stdin.close()
        loop = asyncio.get_running_loop()
        limit = float("inf") if self.faults.timeout_ignored else job.command["timeout_s"]
        timeout = loop.call_later(limit, self._expire, job)
        pumps = [
            asyncio.create_task(self._pump(job, process.stdout, "stdout")),
            asyncio.create_task(self._pump(job, process.stderr, "stderr")),
        ]
        try:
            code = await process.wait()
            await asyncio.wait(pumps, timeout=1.0)
        finally:
            timeout.cancel()
            job.kill()
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
        if job.expired:
            milliseconds = job.command["timeout_s"] * 1000
            self.output(job, "stderr", f"Command timed out after {milliseconds:g} ms\n")
            self.end(job, "timed_out", 124)
        else:
            self.end(job, "exited", code if code >= 0 else 128 - code)

    def _expire(self, job: FakeJob) -> None:
        """The SDK's timeout: SIGTERM to the process group, SIGKILL 5 s later."""
        if job.process is None or job.process.returncode is not None:
            return
        job.expired = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(job.process.pid, signal.SIGTERM)
        job.timers.append(asyncio.get_running_loop().call_later(KILL_AFTER_S, job.kill))

    async def _pump(self, job: FakeJob, stream: asyncio.StreamReader | None, name: str) -> None:
        if stream is None:
            return
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        while chunk := await stream.read(65536):
            self.output(job, name, decoder.decode(chunk))
        self.output(job, name, decoder.decode(b"", final=True))

    def output(self, job: FakeJob, stream: str, text: str) -> None:
        """Keep output up to the limit per stream; flag the rest as truncated."""
        if not text or job.final:
            return
        room = self.output_limit_bytes - job.kept[stream]
        kept = text.encode("utf-8")[: max(room, 0)].decode("utf-8", "ignore")
        if len(kept) < len(text):
            job.truncated[stream] = True
        if kept:
            job.kept[stream] += len(kept.encode("utf-8"))
            job.events.append({"seq": len(job.events) + 1, "type": stream, "data": kept})
        job.changed.fire()

    def end(
        self, job: FakeJob, state: str, exit_code: int | None, error: dict[str, str] | None = None
    ) -> None:
        """Move a job that has not ended to ``state`` (a final one stays as it is)."""
        if job.final:
            return
        job.state, job.exit_code, job.error, job.ended_at = state, exit_code, error, time.time()
        job.changed.fire()

    # --- ending containers ---------------------------------------------------------------

    def destroy(self, job_id: str, by: str) -> bool:
        """Kill the job's processes and remove its directory; False when the destroy failed
        (a fault), and then the fake tries again in :attr:`destroy_retry_s`."""
        job = self.jobs.get(job_id)
        if job is None:
            return False
        if job.destroyed_at is not None:
            return True
        job.destroy_wanted = job.destroy_wanted or by
        if self.faults.take_terminate_failure():
            job.destroy_failures += 1
            loop = asyncio.get_running_loop()
            job.timers.append(loop.call_later(self.destroy_retry_s, self.destroy, job_id, "alarm"))
            job.changed.fire()
            return False
        job.kill()
        for timer in job.timers:
            timer.cancel()
        shutil.rmtree(job.root, ignore_errors=True)
        job.destroyed_at, job.destroyed_by = time.time(), by
        self.ledger.record_destroy(job_id, by)
        job.changed.fire()
        return True

    def cancel(self, job_id: str) -> bool:
        """DELETE: end the job as canceled and destroy its container."""
        job = self.jobs[job_id]
        self.end(job, "canceled", None)
        return self.destroy(job_id, "delete")

    def alarm(self, job_id: str) -> None:
        """The deadline: a job not ended has outlived its timeout (or never got its
        command); whatever its state, its container is destroyed."""
        job = self.jobs.get(job_id)
        if job is not None:
            self.end(job, "timed_out", None)
            self.destroy(job_id, "alarm")

    def vanish(self, job_id: str) -> None:
        """The job's Durable Object restarted under its start or its command: lost, and
        destroyed. A job waiting for its command, or done with it, holds nothing in the
        object's memory: a restart then loses nothing, as in the Worker."""
        job = self.jobs.get(job_id)
        if job is not None and job.busy:
            lost = {"code": "lost", "message": "the Worker restarted under the command"}
            self.end(job, "lost", None, lost)
            self.destroy(job_id, "lost")

    def live(self) -> list[FakeJob]:
        """Jobs whose container is not yet confirmed destroyed, by id (the registry)."""
        return sorted(
            (job for job in self.jobs.values() if job.destroyed_at is None), key=lambda j: j.id
        )

    async def shutdown(self) -> None:
        """Kill every process and remove every job (the fake is going away)."""
        self.hang.set()
        for job in list(self.jobs.values()):
            job.kill()
            for timer in job.timers:
                timer.cancel()
            if job.process is not None:
                await job.process.wait()
            for task in job.tasks:
                task.cancel()
            await asyncio.gather(*job.tasks, return_exceptions=True)
        shutil.rmtree(self.base_dir, ignore_errors=True)
