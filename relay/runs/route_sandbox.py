"""The sandbox a route yields (relay/runs/route.py): the current attempt's sandbox, swapped
for the next provider's while that is safe.

:class:`RouteSandbox` opens the candidates in turn (a warm sandbox on any of them first,
then cold creates, each past its breaker and :class:`~relay.runs.capacity.Capacity`, within
the run's create budget), keeps the current sandbox in an exit stack, and moves the run on
after a provider error before the command was called, or during it for a job that is safe to
repeat. :class:`Routing` is what every route of a replica shares.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass

from relay.cancellation import Deadline
from relay.errors import (
    ProviderError,
    ProviderRefused,
    ProviderTimeout,
    ProviderUnavailable,
    RelayError,
)
from relay.providers.contract import (
    Attempt,
    ExecResult,
    FileEntry,
    OutputSink,
    Provenance,
    Provider,
    Sandbox,
)
from relay.providers.lifecycle import SWEEP_ASIDE
from relay.runs.attempts import ENDED_MEANWHILE, attempt_of, said
from relay.runs.breakers import Breakers
from relay.runs.capacity import Capacity
from relay.runs.event_bus import EventBus, RunEvent
from relay.runs.planning import Candidate
from relay.runs.pools import Pools

log = logging.getLogger("relay.route")

ATTEMPTS = "attempts"
"""The key of a run-ending error's ``details`` that holds the route's attempts."""


@dataclass
class Routing:
    """What every route of one replica shares: its providers and their warm pools, the
    breakers and capacity beside them, the event bus, the run-level create budget."""

    providers: Mapping[str, Provider]
    pools: Pools
    breakers: Breakers
    capacity: Capacity
    events: EventBus
    create_budget_s: float


class RouteSandbox:
    """The sandbox a route yields: the current attempt's, swapped for the next provider's
    while that is safe (relay/runs/route.py says when). ``id`` and ``provenance`` are the
    current sandbox's."""

    def __init__(
        self,
        candidates: Sequence[Candidate],
        retry_safe: bool,
        routing: Routing,
        run_id: str,
        skipped: Mapping[str, str] | None = None,
    ) -> None:
        self.retry_safe = retry_safe
        self.routing = routing
        self.run_id = run_id
        self.left = list(candidates)
        """Candidates not tried yet, in order."""
        self.held = candidates[0].provider
        """The provider the run is counted on for the per-provider caps (its admission's)."""
        self.attempts: list[Attempt] = []
        self.skipped: dict[str, str] = dict(skipped or {})
        """Why each provider skipped without an attempt was skipped (its breaker open, at
        its cap: at the admission or since)."""
        self.create_spent_s = 0.0
        self.exec_called = False
        self.files: Mapping[str, bytes] | None = None
        self._stack: AsyncExitStack | None = None
        self._inner: Sandbox | None = None
        self._provider = ""
        self._create_ms = 0
        self._last: tuple[str, Provenance] | None = None
        """The id and provenance of the last sandbox held (kept after it ends: a run that
        ran out of providers names the last one)."""

    # -- what the run sees ---------------------------------------------------------------

    @property
    def id(self) -> str:
        assert self._last is not None
        return self._last[0]

    @id.setter
    def id(self, value: str) -> None:  # the Sandbox protocol's attribute is settable
        assert self._last is not None
        self._last = (value, self._last[1])

    @property
    def provenance(self) -> Provenance:
        """The current sandbox's (the last one's, once ended), with the attempts before it."""
        assert self._last is not None
        return dataclasses.replace(self._last[1], attempts=tuple(self.attempts))

    @provenance.setter
    def provenance(self, value: Provenance) -> None:
        assert self._last is not None
        self._last = (self._last[0], value)

    async def upload(self, files: Mapping[str, bytes]) -> None:
        self.files = files
        while True:
            assert self._inner is not None
            try:
                await self._inner.upload(files)
                return
            except ProviderError as exc:  # the command has not been called: safe to move on
                await self._fail_over(exc, "uploading files")

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
        called = time.monotonic()
        while True:
            assert self._inner is not None
            # From here the command may have started: only a job safe to repeat moves on.
            self.exec_called = True
            try:
                return await self._inner.exec(
                    argv,
                    stdin=stdin,
                    env=env,
                    workdir=workdir,
                    timeout_s=max(0.0, timeout_s - (time.monotonic() - called)),
                    output=output,
                )
            except ProviderError as exc:
                if not self.retry_safe:
                    raise
                await self._fail_over(exc, "running the command")
                output.clear()  # the run's output is that of the run that finishes
                if self.files:
                    await self.upload(self.files)

    async def list_folder(self, path: str) -> list[FileEntry]:
        # After the command: its files are in the sandbox that ran it, never moved on.
        assert self._inner is not None
        return await self._inner.list_folder(path)

    def read_file(self, path: str, limit: int, size: int | None = None) -> AsyncIterator[bytes]:
        assert self._inner is not None
        return self._inner.read_file(path, limit, size)

    # -- attempts ------------------------------------------------------------------------

    async def open_next(self, after: tuple[Attempt, str] | None) -> None:
        """Open the next candidate's sandbox: a warm one on any provider left, else a cold
        create on each in turn. ``after`` is the attempt that just failed, and how it said
        so. Raises the last error (its ``details`` holding the attempts) when none is left."""
        last: RelayError | None = None
        for candidate in list(self.left):  # claims first, on any provider left
            if await self._claimed(candidate, after):
                return
        while self.left and self._budget_left() > 0:
            candidate = self.left.pop(0)
            if not await self._admitted(candidate.provider):
                continue
            self._announce(after, candidate.provider)
            after = None
            error = await self._created(candidate, more=self._may_go_on())
            if error is None:
                return
            last = error
            after = (self.attempts[-1], said(self.attempts[-1], "creating the sandbox"))
        if after is not None:
            self._announce(after, None)
        raise self._exhausted(last)

    async def _claimed(self, candidate: Candidate, after: tuple[Attempt, str] | None) -> bool:
        """Take a ready warm sandbox of ``candidate``'s, if it has one (a provider whose
        breaker is not closed is left alone: a claim takes no trial)."""
        name, routing = candidate.provider, self.routing
        if not routing.breakers.closed(name) or not routing.pools.has_ready(name, candidate.spec):
            return False
        if not await self._took(name):
            return False
        began = time.monotonic()
        claimed = await routing.pools.claim(name, candidate.spec)
        if claimed is None:
            return False
        self.left.remove(candidate)
        self._announce(after, name)
        stack = AsyncExitStack()
        inner = await stack.enter_async_context(claimed.serving())
        self._hold(stack, inner, name, began)
        return True

    async def _admitted(self, name: str) -> bool:
        """Whether a route may try ``name`` now: its breaker lets it, and it has room for
        the run (the run's count moved there); else a skip, with its reason."""
        breakers = self.routing.breakers
        if not breakers.admits(name):
            left = breakers.cooldown_left(name)
            self.skipped[name] = f"its breaker is open (tried again in {left:.0f} s)"
            return False
        if not await self._took(name):
            breakers.released(name)  # a half-open trial it admitted goes to the next run
            return False
        return True

    async def _took(self, name: str) -> bool:
        """Count the run on ``name`` (per-provider caps); a skip when it is full."""
        capacity = self.routing.capacity
        if not await capacity.take(self.run_id, self.held, name):
            self.skipped[name] = capacity.refusal(name)
            log.info(
                "route: provider at its cap, skipped",
                extra={"run_id": self.run_id, "provider": name},
            )
            return False
        self.held = name
        return True

    def _may_go_on(self) -> bool:
        """Whether another provider may follow this attempt (then its sweep runs aside)."""
        breakers = self.routing.breakers
        return any(breakers.state(c.provider) != "open" for c in self.left)

    async def _created(self, candidate: Candidate, *, more: bool) -> RelayError | None:
        """A cold create on ``candidate`` within what is left of the create budget: None
        when it gave a sandbox (now the current one), else the error it ended with."""
        name, breakers = candidate.provider, self.routing.breakers
        spec = dataclasses.replace(candidate.spec, attempt=len(self.attempts) + 1)
        provider = self.routing.providers[name]
        stack = AsyncExitStack()
        began = time.monotonic()
        aside = SWEEP_ASIDE.set(more)
        try:
            with Deadline(max(0.0, self._budget_left())):
                inner = await stack.enter_async_context(provider.sandbox(spec))
        except ProviderRefused as exc:  # the run's own ask: says nothing of the provider
            breakers.released(name, exc.code)
            return self._failed(name, None, exc, began)
        except ProviderError as exc:
            breakers.failed(name, exc.code)
            return self._failed(name, None, exc, began)
        except TimeoutError:
            # The run's create budget ran out (not the provider's own timeout): no verdict.
            error = ProviderTimeout(
                f"the run's create budget ({self.routing.create_budget_s:g} s) ran out "
                f"while {name} was creating its sandbox"
            )
            breakers.released(name, error.code)
            return self._failed(name, None, error, began)
        except BaseException as exc:  # the request's own fault, a cancellation: no verdict
            breakers.released(name)
            if isinstance(exc, RelayError):
                self.attempts.append(attempt_of(name, None, exc, began))
                exc.details[ATTEMPTS] = tuple(self.attempts)
            else:  # the run ended meanwhile (its deadline, a cancel, a shutdown)
                ended = attempt_of(name, None, RelayError(ENDED_MEANWHILE), began)
                self.attempts.append(dataclasses.replace(ended, error_code="canceled"))
            raise
        finally:
            SWEEP_ASIDE.reset(aside)
            self.create_spent_s += time.monotonic() - began
        breakers.passed(name)
        self._hold(stack, inner, name, began)
        return None

    def _hold(self, stack: AsyncExitStack, inner: Sandbox, name: str, began: float) -> None:
        """``inner`` (of candidate ``name``, asked for at ``began``) is the current sandbox."""
        self._stack, self._inner, self._provider = stack, inner, name
        self._create_ms = _ms_since(began)
        made = inner.provenance
        self._last = (
            inner.id,
            Provenance(name, made.billed_from, pooled=made.pooled, create_ms=self._create_ms),
        )

    def _failed(
        self, name: str, sandbox_id: str | None, error: RelayError, began: float
    ) -> RelayError:
        self.attempts.append(attempt_of(name, sandbox_id, error, began))
        log.warning(
            "route: attempt failed",
            extra={"run_id": self.run_id, "provider": name, "error_code": error.code},
        )
        return error

    async def _fail_over(self, error: ProviderError, action: str) -> None:
        """End the current sandbox after ``error`` and open the next provider's; raise
        ``error`` (its details holding the attempts) when none is left."""
        name, started = self._provider, self.exec_called
        sandbox_id = self._inner.id if self._inner is not None else None
        billed_from = self._inner.provenance.billed_from if self._inner is not None else 0.0
        await self.close(error)
        if not started:  # lost before its command: the provider's fault, as a failed create
            self.routing.breakers.failed(name, error.code)
        attempt = Attempt(
            provider=name,
            sandbox_id=sandbox_id,
            error_code=error.code,
            error_message=error.message,
            create_ms=self._create_ms,
            ended_at=time.time(),
            billed_s=round(time.monotonic() - billed_from, 3),
        )
        self.attempts.append(attempt)
        self._inner, self._create_ms, self.exec_called = None, 0, False
        if self._budget_left() <= 0 or not self.left:
            self._announce((attempt, said(attempt, action)), None)
            error.details[ATTEMPTS] = tuple(self.attempts)
            raise error
        await self.open_next((attempt, said(attempt, action)))

    async def close(self, error: BaseException | None) -> None:
        """End the current sandbox (its provider's context: terminate, shielded)."""
        stack, self._stack = self._stack, None
        if stack is None:
            return
        if error is None:
            await stack.aclose()
            return
        with contextlib.suppress(ProviderError):  # logged by the provider; the run's error wins
            await stack.__aexit__(type(error), error, error.__traceback__)

    def _budget_left(self) -> float:
        return self.routing.create_budget_s - self.create_spent_s

    def _announce(self, after: tuple[Attempt, str] | None, next_provider: str | None) -> None:
        """Tell the run's followers why the last attempt failed and where the run goes."""
        if after is None:
            return
        attempt, said = after
        where = f"trying {next_provider}" if next_provider else "no provider left to try"
        if next_provider is None and self.left and self._budget_left() <= 0:
            where = "the run's create budget is spent"
        if next_provider is not None:
            self.routing.breakers.moved_on(attempt.provider, attempt.error_code)
        message = f"{attempt.provider}: {said}; {where}"
        log.info(message, extra={"run_id": self.run_id, "provider": attempt.provider})
        self.routing.events.publish(
            RunEvent(self.run_id, "attempt", attempt=attempt, message=message)
        )

    def _exhausted(self, last: RelayError | None) -> RelayError:
        """The error a route that ran out of providers ends its run with."""
        skipped = "; ".join(f"{name}: {why}" for name, why in self.skipped.items())
        if last is None:
            retry = min(
                (self.routing.breakers.cooldown_left(name) for name in self.skipped), default=0
            )
            error: RelayError = ProviderUnavailable(
                f"no provider on this run's route can take it now ({skipped})",
                retry_after=retry or None,
            )
        else:
            tried = "; ".join(f"{a.provider}: {a.error_message}" for a in self.attempts)
            also = f"; skipped {skipped}" if skipped else ""
            error = type(last)(
                f"every provider on this run's route failed ({tried}{also})",
                retry_after=last.retry_after,
            )
        error.details[ATTEMPTS] = tuple(self.attempts)
        return error


def _ms_since(began: float) -> int:
    return int((time.monotonic() - began) * 1000)
