"""The fake Worker's state: its jobs, each a real process in a private directory.

A job's container is a host directory standing in for ``/`` (``/workspace`` and ``/tmp``
in it); its command is a real process run there the way the other fakes run one
(:mod:`testing.fakes.vercel.jail`: bubblewrap when it works here, with a private network
when the job's egress is ``[]``; allow-lists are recorded, not enforced). As the Worker
does: the command is killed at ``timeout_s`` (SIGTERM, SIGKILL 5 s later, exit 124 and
"Command timed out"), the container is destroyed when the command ends, and an alarm
destroys it at ``created + timeout_s + grace_s`` whatever happens; a destroy that fails is
retried every :attr:`World.destroy_retry_s`. Everything runs on the fake's event loop; the
ledger is also read from other threads.
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
        self, body: dict[str, Any], digest: str, instance_type: str, egress: tuple[str, list[str]]
    ) -> FakeJob:
        """Record the job, list it, arm its alarm, and start its command."""
        now = time.time()
        job = FakeJob(
            body=body,
            digest=digest,
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
            }
        )
        loop = asyncio.get_running_loop()
        job.timers.append(loop.call_later(job.deadline - now, self.alarm, job.id))
        if self.faults.vanish_after_s is not None:
            job.timers.append(loop.call_later(self.faults.vanish_after_s, self.vanish, job.id))
        job.tasks.append(asyncio.create_task(self._run(job)))
        return job

    async def _run(self, job: FakeJob) -> None:
        body = job.body
        try:
            for directory in (WORKSPACE, "/tmp"):
                (job.root / directory.lstrip("/")).mkdir(parents=True, exist_ok=True)
            prepare_root(job.root)
            for path, content in body["files"].items():
                target = host_path(job.root, f"{WORKSPACE}/{path}")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(base64.b64decode(content))
            cwd = WORKSPACE if body["workdir"] is None else f"{WORKSPACE}/{body['workdir']}"
            host_path(job.root, cwd).mkdir(parents=True, exist_ok=True)
            how = launch(
                job.root,
                ["sh", "-c", 'exec "$@"', "sh", *body["argv"]],
                cwd,
                isolate_network=job.egress[0] == "none",
            )
            environment = {
                "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "HOME": WORKSPACE if how.cwd is None else str(host_path(job.root, WORKSPACE)),
                "LANG": "C.UTF-8",
                **body["env"],
            }
            with self.ledger.lock:
                self.ledger.commands.append(
                    {
                        "id": job.id,
                        "argv": body["argv"],
                        "cwd": cwd,
                        "env_names": sorted(body["env"]),
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
            self.end(job, "error", None, {"code": "start_failed", "message": type(exc).__name__})
            self.destroy(job.id, "exit")
            return
        if job.final:  # ended (canceled, lost) while the process was starting
            job.kill()
            await job.process.wait()
            self.destroy(job.id, "exit")
            return
        job.state, job.started_at = "running", time.time()
        job.changed.fire()
        await self._follow(job)

    async def _follow(self, job: FakeJob) -> None:
        process = job.process
        assert process is not None and process.stdin is not None
        stdin = job.body["stdin"]
        with contextlib.suppress(ConnectionError):
            if stdin is not None:
                process.stdin.write(base64.b64decode(stdin))
                await process.stdin.drain()
            process.stdin.close()
        loop = asyncio.get_running_loop()
        limit = float("inf") if self.faults.timeout_ignored else job.body["timeout_s"]
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
            self.output(
                job, "stderr", f"Command timed out after {job.body['timeout_s'] * 1000:g} ms\n"
            )
            self.end(job, "timed_out", 124)
        else:
            self.end(job, "exited", code if code >= 0 else 128 - code)
        self.destroy(job.id, "exit")

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
        """The deadline: a job still running has outlived its timeout; destroy it."""
        job = self.jobs.get(job_id)
        if job is not None:
            self.end(job, "timed_out", None)
            self.destroy(job_id, "alarm")

    def vanish(self, job_id: str) -> None:
        """The job's Durable Object restarted under its command: lost, and destroyed."""
        job = self.jobs.get(job_id)
        if job is not None:
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
