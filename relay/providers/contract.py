"""The provider contract: the values and protocols the runs see of a sandbox backend.

What ``relay/runs`` imports of the providers lives here: a run's :class:`SandboxSpec`
(resources, egress, tags), what a command gives back (:class:`ExecResult`, the
:class:`OutputSink` its output goes through), a provider's :class:`Rate`, the
:class:`SandboxRef` the reaper lists, and the protocols: :class:`Sandbox`, :class:`Provider`.
How a provider keeps the contract, written once, is relay/providers/lifecycle.py.

A provider turns a :class:`SandboxSpec` into a running sandbox and back into nothing. It
knows nothing of HTTP, tokens or the store. The guarantees (design §4), checked for every
provider by ``tests/contract``:

1. the sandbox is created with the provider's own hard deadline (``spec.lifetime_s``), so
   it dies even if the relay vanishes;
2. it is tagged with ``spec.cluster`` and ``spec.run_id`` (see :data:`TAG_CLUSTER`), so
   :meth:`Provider.list_owned` finds it for the reaper;
3. leaving :meth:`Provider.sandbox` terminates it on every exit path, shielded from
   cancellation; a failed terminate is logged and raised, never swallowed (the reaper
   retries it). The caller waits for it a bounded time: a terminate, or the sweep after a
   failed create, still going then goes on beside serving, tracked, until it ends what it
   must (relay/providers/aftercare.py);
4. SDK exceptions become :class:`relay.errors.ProviderError` subclasses, without the
   provider's body, headers or keys;
5. output goes through an :class:`OutputSink`, which keeps at most ``limit`` bytes per
   stream and records truncation;
6. a job's environment has one door, :meth:`Sandbox.exec`'s ``env``, the whole of it (the
   job's variables, its params', the request's): a provider passes it with the command,
   never at create, where a spec carries none (a warm pool's sandbox is made before the run
   that asks for it exists; a route's is made by whichever provider takes the run);
7. a command that ends as if killed (137, -1, -9, no exit status) in a sandbox the provider
   no longer has is :class:`relay.errors.SandboxLost`, not the job's own exit;
8. a sandbox's files are read through the provider's own file API (:meth:`Sandbox.list_folder`,
   :meth:`Sandbox.read_file`), links never followed where the API tells them apart, special
   files never opened, a read never past what was asked where the API streams; a path it
   will not read is :class:`relay.errors.FileUnreadable`, with the reason.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from datetime import datetime
from typing import ClassVar, Literal, Protocol, runtime_checkable

from relay.errors import EgressUnsupported
from relay.settings import ProviderSettings

TAG_CLUSTER = "relay-cluster"
"""Tag (label, metadata key) naming the relay cluster that owns a sandbox."""
TAG_RUN = "relay-run"
"""Tag naming the run a sandbox belongs to."""
TAG_ATTEMPT = "relay-attempt"
"""Tag naming which of its run's attempts a sandbox is (1, 2, …), on a route of several
providers (relay/runs/route.py)."""
POOL_PREFIX = "pool_"
"""Starts the run tag of a warm pool's sandbox (relay/runs/pools.py): created before any
run, the reaper finds it by this tag in the store's pooled rows, not among the runs."""

StreamName = Literal["stdout", "stderr"]
FileKind = Literal["file", "folder", "link", "other"]
"""What a sandbox folder's entry is: ``link`` a symbolic link (never followed), ``other`` a
device, FIFO or socket (never opened)."""
OutputListener = Callable[[StreamName, bytes], None]


@dataclass(frozen=True)
class Rate:
    """USD per second for one vCPU, and for one GiB of memory (a provider's list price)."""

    vcpu_s: float
    gib_s: float


@dataclass(frozen=True)
class Resources:
    """What a run asks of the sandbox: vCPUs, memory and disk."""

    cpu: float = 1.0
    memory_mb: int = 1024
    disk_mb: int = 1024


@dataclass(frozen=True)
class Egress:
    """Network policy: ``()`` no network, ``("*",)`` everything, else an allow-list."""

    hosts: tuple[str, ...] = ()

    @property
    def none(self) -> bool:
        return not self.hosts

    @property
    def open(self) -> bool:
        return self.hosts == ("*",)

    @property
    def allow_list(self) -> tuple[str, ...]:
        return () if self.open else self.hosts

    def cidrs(self, provider: str) -> list[str]:
        """The allow-list as CIDRs, or :class:`EgressUnsupported` for a host name."""
        networks: list[str] = []
        for host in self.allow_list:
            try:
                networks.append(str(ipaddress.ip_network(host, strict=False)))
            except ValueError as exc:
                raise EgressUnsupported(
                    f"{provider} can only allow IP addresses or CIDR ranges, not host names"
                ) from exc
        return networks


@dataclass(frozen=True)
class SandboxSpec:
    """Everything a provider needs to create one sandbox for one run."""

    run_id: str
    cluster: str
    timeout_s: float
    grace_s: float = 30.0
    image: str | None = None
    resources: Resources = field(default_factory=Resources)
    egress: Egress = field(default_factory=Egress)
    pip: tuple[str, ...] = ()
    job: str | None = None
    """The declared job the sandbox is for (None: a raw command): a source that keeps
    sandboxes made ahead for a job (a warm pool) serves only that job's runs. Providers
    ignore it."""
    attempt: int | None = None
    """Which of its run's attempts this sandbox is, on a route of several providers (a tag,
    :data:`TAG_ATTEMPT`); None on a one-provider route."""

    @property
    def lifetime_s(self) -> int:
        """The provider-side hard deadline: run timeout plus grace, whole seconds up."""
        return int(-(-(self.timeout_s + self.grace_s) // 1))

    @property
    def tags(self) -> dict[str, str]:
        if self.attempt is None:
            return {TAG_CLUSTER: self.cluster, TAG_RUN: self.run_id}
        return {TAG_CLUSTER: self.cluster, TAG_RUN: self.run_id, TAG_ATTEMPT: str(self.attempt)}


@dataclass(frozen=True)
class SandboxRef:
    """A sandbox the provider reports as owned by this relay's cluster."""

    sandbox_id: str
    run_id: str | None
    created_at: datetime | None = None
    abandoned: bool = False
    """No relay holds it any more, yet it may still run (``local``: a group of a relay that
    died, whose lock nobody holds): the reaper ends it whatever its run says."""


@dataclass(frozen=True)
class ExecResult:
    """How a command ended. Output lives in the :class:`OutputSink` it wrote to."""

    exit_code: int | None
    memory_limit_mb: int | None = None
    """Set when the kernel killed the job for exceeding its memory limit (that limit)."""


class OutputSink:
    """Collects a command's output, keeping at most ``limit`` bytes per stream.

    Bytes past the limit are counted and dropped, so a job printing a gigabyte costs the
    relay ``limit`` bytes of memory. A listener (live output) sees every kept chunk.
    """

    def __init__(self, limit: int, listener: OutputListener | None = None) -> None:
        self.limit = limit
        self.listener = listener
        self._kept: dict[StreamName, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        self._seen: dict[StreamName, int] = {"stdout": 0, "stderr": 0}
        self._dropped: dict[StreamName, bool] = {"stdout": False, "stderr": False}
        self.first_output_at: float | None = None

    def write(self, stream: StreamName, data: bytes) -> None:
        if not data:
            return
        if self.first_output_at is None:
            self.first_output_at = time.monotonic()
        self._seen[stream] += len(data)
        kept = self._kept[stream]
        room = self.limit - len(kept)
        if room > 0:
            chunk = data[:room]
            kept.extend(chunk)
            if self.listener is not None:
                self.listener(stream, bytes(chunk))

    def output(self, stream: StreamName) -> bytes:
        return bytes(self._kept[stream])

    def clear(self) -> None:
        """Forget the output so far: the command runs again from the start elsewhere (a
        route's safe retry), and the run keeps the output of the run that finished."""
        for kept in self._kept.values():
            kept.clear()
        self._seen = dict.fromkeys(self._seen, 0)
        self._dropped = dict.fromkeys(self._dropped, False)

    def mark_truncated(self, stream: StreamName) -> None:
        """Record that output of ``stream`` was dropped before it reached the sink (a
        provider's own cap, such as the Cloudflare job Worker's): :meth:`truncated` says so."""
        self._dropped[stream] = True

    def truncated(self, stream: StreamName) -> bool:
        return self._seen[stream] > self.limit or self._dropped[stream]

    def text(self, stream: StreamName) -> str:
        return self.output(stream).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Attempt:
    """One provider a route tried for a run that did not run the command to its end: a
    create that failed, or a sandbox lost (before the command started, or during a job
    that is safe to repeat). What the run records of it, and what it billed."""

    provider: str
    sandbox_id: str | None
    """Its sandbox, if the create gave one."""
    error_code: str
    error_message: str
    create_ms: int
    """From the create call to its answer (or to giving up on it)."""
    ended_at: float
    """When the attempt ended (``time.time``)."""
    billed_s: float
    """Seconds its provider billed: from the create call to the attempt's end."""


@dataclass(frozen=True)
class FileEntry:
    """One entry of a folder in a sandbox, as its provider's file API lists it."""

    name: str
    """Its name in the folder, as the provider gives it (checked by whoever uses it)."""
    kind: FileKind
    size: int | None = None
    """Its size in bytes where the listing says (``None``: the read stops at its cap)."""


@dataclass(frozen=True)
class Provenance:
    """Where a sandbox a source yielded came from: what its run records of it (its cost,
    its ``pooled`` timing), whichever source made it."""

    provider: str
    """The provider that made it (the one a run's cost is counted at)."""
    billed_from: float
    """When its provider's billing began (``time.monotonic``): the create call, or the
    claim of a sandbox a warm pool made ahead (its idle time before is the pool's)."""
    pooled: bool = False
    """Whether a warm pool made it ahead of its run."""
    attempts: tuple[Attempt, ...] = ()
    """The attempts before this sandbox that failed (a route's; a provider's: none)."""
    create_ms: int | None = None
    """From this sandbox's create call (or claim) to the sandbox (a route's; else None:
    the run measures it)."""


@runtime_checkable
class Sandbox(Protocol):
    """One live sandbox; valid only inside the ``sandbox()`` context that yielded it."""

    id: str
    provenance: Provenance
    """Where it came from: set by the provider's create, changed by a source that serves
    a sandbox made earlier (a warm pool's claim)."""

    async def upload(self, files: Mapping[str, bytes]) -> None:
        """Write files (paths relative to the workdir, or absolute) before the command."""

    async def exec(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None,
        env: Mapping[str, str],
        workdir: str | None,
        timeout_s: float,
        output: OutputSink,
    ) -> ExecResult:
        """Run ``argv`` (no shell) with exactly the variables of ``env`` (the only door a
        job's environment takes: guarantee 6 above) and stream its output into ``output``.

        The caller enforces the deadline by cancelling this call; ``timeout_s`` is passed
        on to the provider's own command timeout as a second line of defence.
        """

    async def list_folder(self, path: str) -> list[FileEntry]:
        """The entries of the folder at ``path`` (absolute, in the sandbox), links not
        followed; :class:`relay.errors.FileUnreadable` when there is no such folder."""

    def read_file(self, path: str, limit: int, size: int | None = None) -> AsyncIterator[bytes]:
        """The regular file at ``path`` (absolute, in the sandbox) in chunks: its first
        ``limit`` bytes at least (more may come; the caller keeps what it wants), streamed
        where the provider streams. ``size`` is its listed size, for a provider that reads
        whole files. :class:`relay.errors.FileUnreadable` for what it will not read."""


class SandboxSource(Protocol):
    """What a run opens its sandbox through (relay/runs/sources.py): ``sandbox(spec)`` → a
    live sandbox, always ended on leaving. A :class:`Provider` is one (it creates the
    sandbox); a warm pool wrapping a provider is one (a claimed sandbox, else the provider's
    cold one). The run never knows which it holds: the sandbox's :class:`Provenance` says."""

    def sandbox(self, spec: SandboxSpec) -> AbstractAsyncContextManager[Sandbox]:
        """A sandbox for ``spec`` on enter; terminated on exit, whatever happened."""


@runtime_checkable
class Provider(Protocol):
    """A sandbox backend. Instances are made once per relay and shared by all runs."""

    name: ClassVar[str]
    rate: ClassVar[Rate]
    """List prices, the default of ``RELAY_COST_RATES`` (relay/runs/costs.py)."""
    settings_model: ClassVar[type[ProviderSettings] | None]
    """Its own ``RELAY_<NAME>_*`` settings, if any (see :meth:`Settings.section`)."""

    def check(self, spec: SandboxSpec) -> None:
        """Refuse (``EgressUnsupported``, ``SizeUnsupported``) what can't be enforced."""

    def sandbox(self, spec: SandboxSpec) -> AbstractAsyncContextManager[Sandbox]:
        """Create a sandbox on enter; terminate it on exit, whatever happened."""

    async def list_owned(self) -> list[SandboxRef]:
        """Live sandboxes tagged with this relay's cluster name."""

    async def terminate(self, sandbox_id: str) -> None:
        """Terminate a sandbox; a sandbox that is already gone is success."""

    async def aclose(self) -> None:
        """Release clients and connections."""


DEFAULT_WORKDIR = "/workspace"
"""Where a job's files land and its command starts, unless the job says otherwise."""

SANDBOX_MARKER = "SANDBOX_ID"
RESERVED_ENV = frozenset({SANDBOX_MARKER})
"""Variables a provider sets in the sandbox itself (``local`` marks every process with
``SANDBOX_ID`` to find and kill them); neither a job nor a request may set them."""
