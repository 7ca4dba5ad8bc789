"""The lifecycle every provider shares, written once: the base classes a provider subclasses.

:class:`SandboxProvider` and :class:`ProviderSandbox` keep the provider contract
(relay/providers/contract.py, the guarantees listed there) for every provider: the bounded
create and the sweep after a failed one, the shielded terminate that never replaces the
run's error, the bounded listing, the caller's bounds kept (a sweep or a terminate still
going when the answer is due goes on beside serving: relay/providers/aftercare.py),
:class:`relay.errors.SandboxLost` for a sandbox killed under a command, and every SDK
exception mapped through the provider's :data:`ErrorTable` (the capability ``check`` is
the planner's, run once before any sandbox exists). A provider
module is a driver: it supplies ``create``, ``destroy`` (and ``destroy_now`` where it
ends a sandbox without waiting) and ``list_tagged``, a sandbox
class with ``write_files`` and ``run`` (and, for a run's artifacts, ``folder_entries`` and
``file_chunks``: its file API's listing and read), and its :data:`ErrorTable`. A job's
environment takes one door: ``run``'s ``env``, passed with the command (a spec carries none
to create).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import re
import shlex
import time
import types
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import ClassVar, Generic, Protocol, Self, TypeVar

from relay.cancellation import Deadline, finished_within, shielded
from relay.errors import (
    FileUnreadable,
    ProviderAuth,
    ProviderError,
    ProviderRateLimited,
    ProviderRefused,
    ProviderTimeout,
    ProviderUnavailable,
    RelayError,
    SandboxLost,
    ValidationFailed,
)
from relay.providers.aftercare import TERMINATE_WAIT_S, Aftercare
from relay.providers.contract import (
    ExecResult,
    FileEntry,
    OutputSink,
    Provenance,
    Rate,
    SandboxRef,
    SandboxSpec,
)
from relay.settings import ProviderSettings, Settings

log = logging.getLogger("relay.providers")

TIMEOUT_MARGIN_S = 2.0
"""A provider's own command timeout is set this much past the relay's deadline, so the
relay's cancellation (``timed_out``) wins and the provider's is the second line of defence."""
DOMAIN = re.compile(r"^(\*\.)?([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z]{2,63}$", re.I)
"""A host name (or ``*.domain``) an egress allow-list may name."""
KILLED_EXIT_CODES: frozenset[int | None] = frozenset({137, -1, -9, None})
"""How a command killed with its sandbox reads (SIGKILL, a lost status, no status)."""
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

SWEEP_ASIDE: contextvars.ContextVar[bool] = contextvars.ContextVar("sweep_aside", default=False)
"""Set (by a route with another provider to try, relay/runs/route.py) where the sweep after
a failed create may run beside what comes next instead of before it: the next attempt is
on another provider, so the sweep cannot touch its sandbox, and what the sweep leaves, the
reaper ends once the run is final (its sandboxes are tagged with the run)."""


def _status_of(exc: BaseException) -> int | None:
    """The HTTP status an SDK's exception carries, under the names SDKs give it."""
    for name in ("status_code", "status"):
        status = getattr(exc, name, None)
        if isinstance(status, int) and not isinstance(status, bool):
            return status
    return None


def variables_file(env: Mapping[str, str]) -> bytes:
    """A job's variables as lines a POSIX shell reads with ``set -a; . file`` (``NAME='v'``),
    for a provider whose API would otherwise carry them on a command line or in a URL:
    each value quoted whole, so nothing in it is expanded or run."""
    for name in env:
        if not ENV_NAME.match(name):
            raise ValidationFailed(f"env {name!r} is not a variable name")
    return "".join(f"{name}={shlex.quote(value)}\n" for name, value in env.items()).encode()


ErrorMapper = Callable[[BaseException], "ProviderError | type[ProviderError] | None"]
"""Picks the relay error for an SDK exception (an instance, a class, or None: next rule)."""
ErrorTable = Sequence[
    tuple[type[BaseException] | tuple[type[BaseException], ...], type[ProviderError] | ErrorMapper]
]
"""One provider's SDK exceptions → the relay's, first match wins (see
:meth:`SandboxProvider.mapped`): the httpx way, one table per provider, mapped in one place."""

_WORDS: dict[type[ProviderError], str] = {
    ProviderAuth: "{label} refused the relay's credentials while {action}",
    ProviderRateLimited: "{label} is rate limiting the relay ({action})",
    SandboxLost: "the {label} sandbox was gone while {action}",
    ProviderUnavailable: "{label} is unavailable ({action})",
    ProviderTimeout: "{label} did not answer in time while {action}",
}


class ErrorMapping:
    """The block of :meth:`SandboxProvider.mapping`: an SDK exception raised in it leaves
    it as the relay error :meth:`SandboxProvider.mapped` picks (a relay error and a
    cancellation pass as they came). A class, not a ``contextlib.contextmanager``: one is
    entered around every command, and a generator's context costs three times as much."""

    __slots__ = ("action", "in_sandbox", "provider")

    def __init__(self, provider: SandboxProvider[ProviderSandbox], action: str, in_sandbox: bool):
        self.provider, self.action, self.in_sandbox = provider, action, in_sandbox

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: types.TracebackType | None,
    ) -> None:
        if isinstance(error, Exception) and not isinstance(error, RelayError):
            raise self.provider.mapped(error, self.action, in_sandbox=self.in_sandbox) from error


class SandboxOwner(Protocol):
    """What a sandbox uses of its provider (:class:`SandboxProvider` is one)."""

    @property
    def label(self) -> str: ...
    def mapping(
        self, action: str, *, in_sandbox: bool = True
    ) -> contextlib.AbstractContextManager[None]: ...
    async def gone(self, sandbox_id: str) -> bool: ...


class ProviderSandbox(ABC):
    """A live sandbox, valid inside :meth:`SandboxProvider.sandbox`.

    A provider's subclass writes files (:meth:`write_files`) and runs one command
    (:meth:`run`); this base maps their errors and tells a killed sandbox from a job's exit.
    """

    provenance: Provenance
    """Set by :meth:`SandboxProvider.created` (a warm pool's claim changes it)."""

    def __init__(self, provider: SandboxOwner, sandbox_id: str) -> None:
        self.provider = provider
        self.id = sandbox_id

    async def upload(self, files: Mapping[str, bytes]) -> None:
        """Write files (paths relative to the workdir, or absolute) before the command."""
        with self.provider.mapping("uploading files"):
            await self.write_files(files)

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
        """Run ``argv`` (no shell) and stream its output into ``output`` (see :class:`Sandbox`)."""
        with self.provider.mapping("running the command"):
            result = await self.run(
                argv, stdin=stdin, env=env, workdir=workdir, timeout_s=timeout_s, output=output
            )
        if result.exit_code in KILLED_EXIT_CODES and await self.provider.gone(self.id):
            raise SandboxLost(f"the {self.provider.label} sandbox was killed during the run")
        return result

    async def list_folder(self, path: str) -> list[FileEntry]:
        """The entries of the folder at ``path``, links not followed (see :class:`Sandbox`)."""
        with self.provider.mapping("listing files"):
            return await self.folder_entries(path)

    async def read_file(
        self, path: str, limit: int, size: int | None = None
    ) -> AsyncIterator[bytes]:
        """The file at ``path`` in chunks, at least ``limit`` bytes (see :class:`Sandbox`)."""
        with self.provider.mapping("reading a file"):
            async for chunk in self.file_chunks(path, limit, size):
                yield chunk

    @property
    def reads_files(self) -> bool:
        """Whether its driver reads files at all (``folder_entries`` its own)."""
        return type(self).folder_entries is not ProviderSandbox.folder_entries

    async def folder_entries(self, path: str) -> list[FileEntry]:
        """The provider's folder listing; SDK exceptions are mapped by :meth:`list_folder`,
        a missing folder is :class:`FileUnreadable` (the provider's not-found, caught)."""
        raise FileUnreadable(f"the {self.provider.label} provider cannot list files")

    def file_chunks(self, path: str, limit: int, size: int | None) -> AsyncIterator[bytes]:
        """The provider's file read, stopping once ``limit`` bytes came where it streams;
        SDK exceptions are mapped by :meth:`read_file`."""
        raise FileUnreadable(f"the {self.provider.label} provider cannot read files")

    @abstractmethod
    async def write_files(self, files: Mapping[str, bytes]) -> None:
        """The provider's upload; SDK exceptions are mapped by :meth:`upload`."""

    @abstractmethod
    async def run(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None,
        env: Mapping[str, str],
        workdir: str | None,
        timeout_s: float,
        output: OutputSink,
    ) -> ExecResult:
        """The provider's exec; SDK exceptions are mapped by :meth:`exec`."""


S = TypeVar("S", bound=ProviderSandbox, covariant=True)


class SandboxProvider(ABC, Generic[S]):
    """The lifecycle every provider shares, written once.

    :meth:`sandbox` creates (bounded by ``create_timeout_s``; after a failed or cancelled
    create it sweeps what the create may have left: :meth:`left_by_create`, by default the
    sandboxes listed with the run's tag, within what is left of that bound, then beside
    serving), yields, then terminates shielded from any number of cancellations, waiting
    for the terminate at most :data:`~relay.providers.aftercare.TERMINATE_WAIT_S` (it goes
    on beside serving). A failed terminate is logged and left to the reaper; it is raised
    only when nothing else went wrong, never in place of the run's own error. Every SDK
    exception is mapped through :attr:`errors`.
    """

    name: ClassVar[str]
    label: ClassVar[str]
    """The provider's name in messages (``E2B``, ``Modal``)."""
    rate: ClassVar[Rate] = Rate(0.0, 0.0)
    """List prices, the default of ``RELAY_COST_RATES`` (relay/runs/costs.py)."""
    errors: ClassVar[ErrorTable] = ()
    settings_model: ClassVar[type[ProviderSettings] | None] = None
    """Its own ``RELAY_<NAME>_*`` settings (keys, URLs), read with ``Settings.section``."""
    retry_after_s: ClassVar[float] = 5.0
    """Suggested delay of a rate-limited answer whose SDK hides the provider's own."""
    terminate_timeout_s: ClassVar[float] = 20.0
    sweep_timeout_s: ClassVar[float] = 10.0
    list_timeout_s: float = 60.0
    """Bound on one :meth:`list_owned`: a provider that accepts the call and never answers
    must not hold the reaper's sweep (every provider's, every later one) for ever; some
    SDKs (Daytona's list, Modal's gRPC) have no timeout of their own."""

    create_timeout_s: float = 60.0
    extends_lifetime: ClassVar[bool] = False
    """Whether :meth:`extend_lifetime` can move a live sandbox's hard deadline (a warm
    pool's sandbox then gets its run's lifetime when claimed, not when created)."""
    skips_warm_pools: ClassVar[str | None] = None
    """Why a warm pool would not make this provider's runs faster, where it would not (its
    create costs less than a pool's claim, the conditional UPDATE of the pool row committed
    with its turn of the loop, and the refill a claim starts competes with the claiming
    run): a job with ``warm = N`` on it loads, keeps no sandbox, is shown as skipped with
    this reason, and its runs take the cold path (relay/runs/pools.py). None: pools help,
    the create is the wait."""

    @classmethod
    def for_reaper(cls, settings: Settings) -> Self:
        """The provider built for ``relay reap``, which lists and terminates and creates
        nothing: coming up it ends nothing. What its start would end for a relay that
        serves (``local``: what a relay that died left), its listing names ``abandoned``
        for the reaper's sweep, which ends it, or in a dry run says it would. Built as for
        serving by default: making a client ends nothing."""
        return cls(settings)  # type: ignore[call-arg]

    # -- what a provider supplies -----------------------------------------------------------

    def check(self, spec: SandboxSpec) -> None:
        """Refuse (``EgressUnsupported``, ``SizeUnsupported``) what can't be enforced.

        The planner calls it once per run, before any sandbox exists."""

    @abstractmethod
    async def create(self, spec: SandboxSpec) -> S:
        """Create one sandbox with the spec's lifetime and tags."""

    @abstractmethod
    async def destroy(self, sandbox_id: str) -> None:
        """End a sandbox; one already gone may raise what maps to :class:`SandboxLost`."""

    def destroy_now(self, sandbox_id: str) -> bool:
        """End a sandbox without waiting, where the provider can (its sandboxes live in
        this process: the memory provider's): True once ended, False to go through
        :meth:`destroy` (the default; a provider over a network always waits). Raises as
        :meth:`destroy` does. Lets :meth:`ended` skip the task and the wait a terminate
        otherwise takes."""
        return False

    @abstractmethod
    async def list_tagged(self) -> list[SandboxRef]:
        """Live sandboxes tagged with this relay's cluster."""

    async def aclose(self) -> None:
        """Release clients and connections."""

    async def extend_lifetime(self, sandbox_id: str, lifetime_s: int) -> None:
        """Make the sandbox's hard deadline ``lifetime_s`` from now (only where
        :attr:`extends_lifetime`; E2B's ``set_timeout`` is one). Called through
        :meth:`extended`, which bounds it and maps its errors."""
        raise NotImplementedError(f"{self.label} cannot extend a sandbox's lifetime")

    def may_have_created(self, error: ProviderError) -> bool:
        """Whether a create that failed so may have left a sandbox to sweep."""
        return not isinstance(error, ProviderAuth | ProviderRateLimited)

    def create_timed_out(self) -> ProviderError:
        return ProviderTimeout(f"{self.label} did not create the sandbox in time")

    async def gone(self, sandbox_id: str) -> bool:
        """Whether the provider no longer has this sandbox (unknown: ``False``)."""
        try:
            return all(ref.sandbox_id != sandbox_id for ref in await self.list_owned())
        except ProviderError:
            return False

    @property
    def aftercare(self) -> Aftercare:
        """The cleanup this provider does beside serving (relay/providers/aftercare.py)."""
        found: Aftercare | None = self.__dict__.get("_aftercare")
        if found is None:
            found = self.__dict__["_aftercare"] = Aftercare(self.name)
        return found

    # -- the lifecycle ----------------------------------------------------------------------

    @asynccontextmanager
    async def sandbox(self, spec: SandboxSpec) -> AsyncIterator[S]:
        """Create a sandbox on enter; terminate it on exit, whatever happened."""
        # What serving() does, written out: one generator a run, not two. A generator, not
        # a class: one abandoned by a coroutine nobody resumes still terminates its sandbox
        # when collected (the loop's finalizer closes it).
        box = await self.created(spec)
        try:
            yield box
        except BaseException:
            with contextlib.suppress(ProviderError):  # logged; the run's error is the one
                await self.ended(box.id)
            raise
        await self.ended(box.id)

    @asynccontextmanager
    async def serving(self, box: ProviderSandbox) -> AsyncIterator[ProviderSandbox]:
        """Terminate a sandbox created earlier (a warm pool's) on exit, whatever happened,
        as :meth:`sandbox` does."""
        try:
            yield box
        except BaseException:
            with contextlib.suppress(ProviderError):  # logged; the run's error is the one
                await self.ended(box.id)
            raise
        await self.ended(box.id)

    async def ended(self, sandbox_id: str) -> None:
        """:meth:`terminate` in a task of its own, which no cancellation of the caller
        interrupts (raised again once done waiting), waited for at most
        :data:`~relay.providers.aftercare.TERMINATE_WAIT_S`: a provider that does not answer
        must not hold the run's answer. Still going then, it goes on beside serving (within
        ``terminate_timeout_s``; its failure logged, the reaper retrying it). A provider
        that ends it without waiting (:meth:`destroy_now`) needs neither: nothing can
        cancel or outlast a call that does not wait."""
        try:
            if self.destroy_now(sandbox_id):
                return
        except Exception as exc:
            self._terminate_failed(sandbox_id, exc)
            return  # already gone
        ending = asyncio.get_running_loop().create_task(self.terminate(sandbox_id))
        cancelled = await finished_within(ending, TERMINATE_WAIT_S)
        if ending.done():
            ending.result()  # its failure raised, as terminate's (before a cancellation)
        else:
            self.aftercare.adopt(ending, f"terminating sandbox {sandbox_id}")
        if cancelled:
            raise asyncio.CancelledError

    async def created(self, spec: SandboxSpec) -> S:
        """Create a sandbox the caller terminates (:meth:`sandbox` and a warm pool use it):
        bounded by ``create_timeout_s``, swept after a failed or cancelled create. Its
        :attr:`~ProviderSandbox.provenance` says billing began with this call."""
        called = time.monotonic()
        try:
            with Deadline(self.create_timeout_s):
                box = await self.create(spec)
        except RelayError as exc:
            if not isinstance(exc, ProviderError):
                raise  # the request's own fault (a size, a path): nothing was created
            error: ProviderError | None = exc
            if self.may_have_created(exc):
                await shielded(self._swept(spec, called))
            raise
        except BaseException as exc:
            error = None
            if isinstance(exc, TimeoutError):
                error = self.create_timed_out()
            elif isinstance(exc, Exception):
                error = self.mapped(exc, "creating the sandbox", in_sandbox=False)
            if error is None or self.may_have_created(error):
                await shielded(self._swept(spec, called))
            if error is None:
                raise
            raise error from exc
        box.provenance = Provenance(self.name, billed_from=called)
        return box

    async def extended(self, sandbox_id: str, lifetime_s: int) -> None:
        """:meth:`extend_lifetime`, bounded by ``create_timeout_s`` like the create it
        stands in for (a warm pool's claim), its SDK errors mapped."""
        try:
            with (
                Deadline(self.create_timeout_s),
                self.mapping("extending the sandbox's lifetime", in_sandbox=False),
            ):
                await self.extend_lifetime(sandbox_id, lifetime_s)
        except TimeoutError as exc:
            raise ProviderTimeout(
                f"{self.label} did not extend the sandbox's lifetime in time"
            ) from exc

    async def left_by_create(self, spec: SandboxSpec) -> list[str]:
        """The sandboxes a failed create of ``spec`` may have left: by default those listed
        with its run's tag. A provider whose sandbox is named by the relay before the create
        (Sprites) answers that name instead, so a listing it can't trust is not needed."""
        return [ref.sandbox_id for ref in await self.list_owned() if ref.run_id == spec.run_id]

    async def _swept(self, spec: SandboxSpec, called: float) -> None:
        """Sweep what a failed create left (:meth:`_sweep`) beside serving, waited for within
        what is left of the create's bound (``create_timeout_s`` from ``called``): the caller
        has its answer by then. Not waited for at all where a route has another provider to
        try (:data:`SWEEP_ASIDE`): the next attempt cannot be touched by this sweep."""
        sweep = self.aftercare.start(
            self._sweep(spec), f"the sweep after run {spec.run_id}'s failed create"
        )
        left = called + self.create_timeout_s - time.monotonic()
        if sweep is not None and left > 0 and not SWEEP_ASIDE.get():
            await asyncio.wait({sweep}, timeout=left)

    async def _sweep(self, spec: SandboxSpec) -> None:
        """Terminate what a failed create left (:meth:`left_by_create`; bounded, best effort)."""
        # Best effort, bounded: what the sweep leaves, the reaper ends.
        with contextlib.suppress(TimeoutError), Deadline(self.sweep_timeout_s):
            try:
                for sandbox_id in await self.left_by_create(spec):
                    log.warning(
                        "%s sandbox %s: terminating after a failed create",
                        self.name,
                        sandbox_id,
                    )
                    await self.terminate(sandbox_id)
            except ProviderError as exc:
                log.warning(
                    "%s: sweep after a failed create of run %s failed (%s)",
                    self.name,
                    spec.run_id,
                    type(exc.__cause__ or exc).__name__,
                )

    async def terminate(self, sandbox_id: str) -> None:
        """Terminate a sandbox; one already gone is success. A failure is logged and raised
        (the reaper retries it)."""
        try:
            with Deadline(self.terminate_timeout_s):
                await self.destroy(sandbox_id)
        except TimeoutError as exc:
            self._terminate_failed(
                sandbox_id,
                exc,
                ProviderTimeout(f"{self.label} did not terminate the sandbox in time"),
            )
        except Exception as exc:
            self._terminate_failed(sandbox_id, exc)

    def _terminate_failed(
        self, sandbox_id: str, cause: BaseException, error: ProviderError | None = None
    ) -> None:
        """A terminate that raised ``cause``: success if the sandbox was gone already, else
        ``error`` (by default ``cause`` mapped) logged and raised (the reaper retries it)."""
        if error is None:
            error = self.mapped(cause, "terminating the sandbox")
            if isinstance(error, SandboxLost):
                return  # already gone: that is what we wanted
        log.error(
            "%s sandbox %s: terminate failed (%s); the reaper will retry",
            self.name,
            sandbox_id,
            type(cause.__cause__ or cause).__name__,
            extra={"provider": self.name, "sandbox_id": sandbox_id},
        )
        raise error from cause

    async def list_owned(self) -> list[SandboxRef]:
        """Live sandboxes tagged with this relay's cluster name, within ``list_timeout_s``
        (else :class:`ProviderTimeout`)."""
        try:
            with Deadline(self.list_timeout_s), self.mapping("listing sandboxes", in_sandbox=False):
                return await self.list_tagged()
        except TimeoutError as exc:  # the deadline's: the SDK's own are mapped inside
            raise ProviderTimeout(f"{self.label} did not list its sandboxes in time") from exc

    # -- errors -----------------------------------------------------------------------------

    def mapping(self, action: str, *, in_sandbox: bool = True) -> ErrorMapping:
        """Raise SDK exceptions of the block as relay errors (cancellation passes)."""
        return ErrorMapping(self, action, in_sandbox)

    def mapped(self, exc: BaseException, action: str, *, in_sandbox: bool = True) -> ProviderError:
        """The relay error for an SDK exception, from :attr:`errors`; words are ours only.

        Outside a sandbox (create, list) a "gone" answer is a plain provider error."""
        if isinstance(exc, ProviderError):
            return exc
        found: ProviderError | type[ProviderError] | None = None
        for kinds, target in self.errors:
            if isinstance(exc, kinds):
                found = target if isinstance(target, type) else target(exc)
                if found is not None:
                    break
        if found is None:
            if isinstance(exc, TimeoutError):
                found = ProviderTimeout
            elif (status := _status_of(exc)) is not None and 400 <= status < 500:
                # An answer about what was asked (a name, a size, a field), no outage.
                return ProviderRefused(
                    f"{self.label} refused the request while {action} (HTTP {status})"
                )
            else:
                return ProviderError(f"{self.label} failed while {action} ({type(exc).__name__})")
        if isinstance(found, type) and found is SandboxLost and not in_sandbox:
            found = ProviderError
        if isinstance(found, ProviderError):
            return found
        words = _WORDS.get(found, "{label} failed while {action}")
        message = words.format(label=self.label, action=action)
        if found is ProviderRateLimited:
            return ProviderRateLimited(message, retry_after=self.retry_after_s)
        return found(message)
