"""Benchmark (3): the ``echo`` job on the local provider, end to end over HTTP, against
spawning the same bubblewrap sandbox directly.

Three ways, interleaved so that drift on a shared machine hits them alike:

* **direct** — the physical floor: spawn the exact invocation the local provider builds
  (``LocalSandbox.launch``: prlimit, bwrap with its options in a memfd, namespaces, binds,
  size-capped tmpfs mounts, the ``timeout -s KILL`` wrapper) with the same environment,
  unblock it at once (``--block-fd``, no cgroup), read its output, wait for it;
* **provider** — the same through the provider API (``LocalProvider.sandbox`` + ``exec``,
  which adds the sandbox's tag file and its terminate sweep), no HTTP and no store;
* **relay** — ``POST /v1/runs`` with ``{"job": "echo"}`` on a running relay.

And what three parts of a sandbox cost to create, measured on their own (rows that are no
way of running echo): **cgroup** — a sandbox's cgroup made, limited and removed (only where
cgroups can be used); **uid** — a sandbox's own host uid taken and released (a relay
running as root; direct takes its uid outside its timing, as it makes no cgroup, while the
provider and the relay pay both); **provider, egress star** — the provider's echo with
``egress = ["*"]``, whose difference from **provider** is the private network (pasta or
slirp4netns) attached and closed (only where such a tool is installed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.client import KeepAliveClient
from relay.providers.contract import Egress, OutputSink, Resources, SandboxSpec
from relay.providers.local import cgroups
from relay.providers.local.provider import LocalProvider
from relay.providers.local.sandbox import LocalSandbox
from relay.runs.models import SIZES, Size
from relay.settings import Settings

MESSAGE = "hello from the benchmark"
ECHO = ["echo", MESSAGE]
TIMEOUT_S = 10.0  # the echo job's own timeout_s, so the argv matches the relay's


@dataclass(frozen=True)
class Timing:
    """Latencies of one way of running echo, in milliseconds."""

    name: str
    samples: tuple[float, ...]

    @property
    def p50_ms(self) -> float:
        return statistics.median(self.samples)

    @property
    def p99_ms(self) -> float:
        ordered = sorted(self.samples)
        return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def _spec(run_id: str, grace_s: float) -> SandboxSpec:
    cpu, memory_mb, disk_mb = SIZES[Size.small]
    return SandboxSpec(
        run_id=run_id,
        cluster="bench",
        timeout_s=TIMEOUT_S,
        grace_s=grace_s,
        resources=Resources(cpu=cpu, memory_mb=memory_mb, disk_mb=disk_mb),
    )


async def _direct_once(provider: LocalProvider, grace_s: float) -> float:
    sandbox_id = f"direct-{secrets.token_hex(6)}"
    box = LocalSandbox(provider, sandbox_id, _spec(sandbox_id, grace_s))
    # As root, the sandbox's own uid, taken outside the timing like its cgroup (row "uid").
    box.uid = provider.uids.take() if provider.uids is not None else None
    started = time.perf_counter()
    left = max(1, int(box.spec.lifetime_s))
    try:
        invocation = box.launch(ECHO, "/workspace", left, {}, lifetime_s=left)
    except BaseException:
        if box.uid is not None:
            box.uid.release()
        raise
    try:
        process = await asyncio.create_subprocess_exec(
            *invocation.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=invocation.env,
            cwd=invocation.cwd,
            start_new_session=True,
            preexec_fn=invocation.setup,
            pass_fds=invocation.child_fds(),
        )
        invocation.close_child_ends()
        if invocation.block is not None:
            os.write(invocation.block[1], b"1")
        stdout, _ = await process.communicate()
    finally:
        invocation.close()
        if box.uid is not None:
            box.uid.release()
    elapsed = (time.perf_counter() - started) * 1000
    if process.returncode != 0 or stdout.decode().strip() != MESSAGE:
        raise RuntimeError(f"direct bwrap echo failed: exit {process.returncode}")
    return elapsed


def _uid_once(provider: LocalProvider) -> float:
    """A sandbox's own uid taken and released (a relay running as root)."""
    assert provider.uids is not None
    started = time.perf_counter()
    provider.uids.take().release()
    return (time.perf_counter() - started) * 1000


def _cgroup_once(provider: LocalProvider) -> float:
    assert provider.tree is not None
    limits = cgroups.GroupLimits(memory_bytes=1 << 30, pids=256, cpus=1.0)
    started = time.perf_counter()
    provider.tree.create(f"bench-{secrets.token_hex(6)}", limits).remove()
    return (time.perf_counter() - started) * 1000


async def _provider_once(
    provider: LocalProvider, grace_s: float, *, open_egress: bool = False
) -> float:
    started = time.perf_counter()
    sink = OutputSink(1 << 20)
    spec = _spec(f"run_{secrets.token_hex(8)}", grace_s)
    if open_egress:
        spec = dataclasses.replace(spec, egress=Egress(("*",)))
    async with provider.sandbox(spec) as box:
        result = await box.exec(
            ECHO, stdin=None, env={}, workdir=None, timeout_s=TIMEOUT_S, output=sink
        )
    elapsed = (time.perf_counter() - started) * 1000
    if result.exit_code != 0 or sink.text("stdout").strip() != MESSAGE:
        raise RuntimeError(f"provider echo failed: exit {result.exit_code}")
    return elapsed


def _relay_once(client: KeepAliveClient) -> float:
    started = time.perf_counter()
    status, run = client.post("/v1/runs", {"job": "echo", "params": {"message": MESSAGE}})
    elapsed = (time.perf_counter() - started) * 1000
    if status != 200 or run.get("state") != "succeeded" or run["stdout"].strip() != MESSAGE:
        raise RuntimeError(f"relay echo failed: {status} {run.get('state') or run.get('error')}")
    return elapsed


def run(url: str, token: str, *, rounds: int, grace_s: float = 30.0) -> list[Timing]:
    """``rounds`` of each way, interleaved; the first round of each is a warm-up."""
    root = Path(tempfile.mkdtemp(prefix="relay-bench-local-"))
    settings = Settings(
        _env_file=None,
        local_isolation="bwrap",
        local_root=root,
        cluster="bench",
        grace_s=grace_s,
    )
    provider = LocalProvider(settings)
    client = KeepAliveClient(url, token)
    samples: dict[str, list[float]] = {"direct": [], "provider": [], "relay": []}
    if provider.tree is not None:
        samples["cgroup"] = []
    if provider.uids is not None:
        samples["uid"] = []
    if provider.network is not None:
        samples["provider, egress *"] = []
    loop = asyncio.new_event_loop()
    try:
        for index in range(rounds + 1):
            direct = loop.run_until_complete(_direct_once(provider, grace_s))
            through_provider = loop.run_until_complete(_provider_once(provider, grace_s))
            relay = _relay_once(client)
            extra: dict[str, float] = {}
            if "cgroup" in samples:
                extra["cgroup"] = _cgroup_once(provider)
            if "uid" in samples:
                extra["uid"] = _uid_once(provider)
            if "provider, egress *" in samples:
                extra["provider, egress *"] = loop.run_until_complete(
                    _provider_once(provider, grace_s, open_egress=True)
                )
            if index:
                samples["direct"].append(direct)
                samples["provider"].append(through_provider)
                samples["relay"].append(relay)
                for name, value in extra.items():
                    samples[name].append(value)
    finally:
        client.close()
        loop.run_until_complete(provider.aclose())
        loop.close()
        shutil.rmtree(root, ignore_errors=True)
    return [Timing(name, tuple(values)) for name, values in samples.items()]
