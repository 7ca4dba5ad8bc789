"""Warm pools: sandboxes created ahead for a job, so a run waits for its job, not a boot.

A job opts in with ``warm = N`` in its job.toml (``RELAY_POOL_WARM`` overrides it per job);
``RELAY_POOL_MAX`` caps the pooled sandboxes of all jobs and replicas together. One pool
per job, of the job's own shape: its provider, image, size, egress and packages.

- A pooled sandbox is made by the provider's normal create, tagged with a ``pool_…`` run
  tag (:data:`~relay.providers.contract.POOL_PREFIX`) and recorded in the store before the
  create starts (relay/store/pools.py: which replica holds it, its state), so none is ever
  untracked.
- Its provider-side hard lifetime covers its idle time (``RELAY_POOL_IDLE_S``), the job's
  timeout and the grace. A provider that can extend a live sandbox's lifetime
  (``extends_lifetime``) creates it for the idle time and grace only, and gives it the run's
  timeout and grace when a run claims it; for the others the idle time is capped (a
  sandbox idle that long is no longer claimable), so the lifetime holds either way.
- A run whose spec has the pool's exact shape claims a ready sandbox with one conditional
  UPDATE (exactly one claimant wins, across replicas too); it serves that one run and is
  terminated when the run ends, like any other. Any other shape, an empty pool or a burst
  past it takes the cold path, without an error. A run reaches its pool through its door
  (relay/runs/sources.py: the pool is a source of the provider's own shape).
- The pool refills in the background, at most :data:`REFILL_CONCURRENCY` creates at once,
  backing off after failed creates. A sandbox idle past its time is terminated and
  replaced; shutdown terminates the pool; the reaper ends a dead replica's
  (relay/runs/reaper.py).
- A jobs reload (relay/runs/jobs_folder.py) changes the pools with it (:meth:`Pools.follow`):
  a job whose shape and timeout stay keeps its pool and sandboxes at its new size; a pool
  whose job changed shape or went away is retired, its sandboxes terminated; a new one fills.
- A provider whose create costs less than a claim (local: a folder and a cgroup) declares
  it (:attr:`~relay.providers.lifecycle.SandboxProvider.skips_warm_pools`, with the
  reason): a job with ``warm = N`` on it loads all the same (a jobs folder may be shared
  with hosts whose provider differs), is logged once with the reason, shown as skipped in
  ``/v1/health`` and the console, holds no sandbox, and its runs take the cold path, since
  a pool would make them slower, not faster (bench/README.md, (5)).
- Its idle time (created → claimed or terminated) is billed by the provider: each row
  records it and its cost at the shape's rate (``RELAY_COST_RATES`` applies), shown in
  ``/v1/usage`` and ``/metrics``. A pooled run's own cost starts at its claim.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field

from relay.cancellation import shielded
from relay.errors import ProviderError
from relay.providers.contract import (
    POOL_PREFIX,
    Egress,
    Provenance,
    Provider,
    Resources,
    SandboxSpec,
)
from relay.providers.lifecycle import ProviderSandbox, SandboxProvider
from relay.runs.catalog import Catalog, JobSpec
from relay.runs.costs import CostModel
from relay.runs.models import SIZES
from relay.runs.planning import image_for
from relay.settings import Settings
from relay.store.database import Store
from relay.store.pools import CLAIMED, CREATING, READY, PoolRecord, PoolRows

log = logging.getLogger("relay.pools")

REFILL_CONCURRENCY = 4
"""Creates the pools of one replica make at once."""
TICK_S = 1.0
"""How often the pools look for expired sandboxes and room to refill, at most."""
BACKOFF_S = (1.0, 60.0)
"""After a failed create a pool waits the first figure, doubling up to the second."""

AnyProvider = SandboxProvider[ProviderSandbox]


@dataclass(frozen=True)
class Shape:
    """What a pooled sandbox is made for: a run of another shape cannot use it."""

    job: str
    provider: str
    image: str | None
    resources: Resources
    egress: Egress
    pip: tuple[str, ...]

    @classmethod
    def of(cls, provider: str, spec: SandboxSpec) -> Shape | None:
        """The shape of ``spec`` on ``provider``; None for a raw command (no job's)."""
        if spec.job is None:
            return None
        return cls(spec.job, provider, spec.image, spec.resources, spec.egress, spec.pip)

    @property
    def key(self) -> str:
        return hashlib.sha256(repr(self).encode()).hexdigest()[:32]


@dataclass
class _Ready:
    box: ProviderSandbox
    created_at: float
    expires_at: float


@dataclass
class Pool:
    """One job's pool on this replica: its shape, size and ready sandboxes."""

    shape: Shape
    target: int
    provider: AnyProvider
    timeout_s: float
    """The job's longest run: what the sandbox's lifetime must cover after its idle time."""
    usd_per_s: float
    ready: dict[str, _Ready] = field(default_factory=dict)
    creating: int = 0
    failures: int = 0
    retry_at: float = 0.0
    retired: bool = False
    """Its job changed shape or went away with a jobs reload: emptied, never filled again."""

    def serves_as(self, other: Pool) -> bool:
        """Whether this pool's sandboxes fit ``other``'s runs (its size may differ)."""
        return (self.shape, self.timeout_s, self.provider) == (
            other.shape,
            other.timeout_s,
            other.provider,
        )


@dataclass(frozen=True)
class Skipped:
    """A job's ``warm = N`` this replica keeps no pool for: its provider's create costs
    less than a claim (:attr:`SandboxProvider.skips_warm_pools` says why)."""

    job: str
    provider: str
    reason: str


@dataclass
class PoolStats:
    """This replica's pool numbers since it started (``/metrics``)."""

    created: int = 0
    claimed: int = 0
    expired: int = 0
    failed: int = 0
    idle_s: float = 0.0
    idle_usd: float = 0.0


class Claimed:
    """A pooled sandbox a run has claimed: :meth:`serving` terminates it when left."""

    def __init__(self, pools: Pools, pool: Pool, record: PoolRecord, box: ProviderSandbox):
        self.pools, self.pool, self.record, self.box = pools, pool, record, box

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[ProviderSandbox]:
        """The sandbox, now its run's: billed to the run from here (its idle time before
        was the pool's); terminated on leaving."""
        try:
            async with self.pool.provider.serving(self.box):
                provider = self.pool.shape.provider
                self.box.provenance = Provenance(provider, time.monotonic(), pooled=True)
                yield self.box
        finally:
            # Ended even when the terminate failed: the reaper terminates a sandbox
            # whose row is ended (relay/runs/reaper.py).
            rows, now = self.pools.rows, self.pools.clock()
            with contextlib.suppress(Exception):
                await shielded(rows.end(self.record.id, now, 0.0, states=(CLAIMED,)))

    async def discard(self) -> None:
        """Terminate it and end its row without serving a run."""
        async with self.serving():
            pass


class Pools:
    """Every warm pool of this replica: claims, the refill loop, expiry and drain."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        catalog: Catalog,
        providers: Mapping[str, Provider],
        costs: CostModel,
        *,
        instance_id: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.rows = PoolRows(store)
        self.instance_id = instance_id
        self.clock = clock
        self.stats = PoolStats()
        self.providers = providers
        self.costs = costs
        self.skipped: dict[str, Skipped] = {}
        """The jobs whose ``warm`` is skipped, by name: their provider's create is cheaper
        than a claim. Replaced whole, like :attr:`pools`."""
        self.pools: dict[tuple[str, str], Pool] = self._pools_of(catalog)
        """Replaced whole, never changed in place: a loop over it may await."""
        self._wake = asyncio.Event()
        self._filling: set[asyncio.Task[None]] = set()
        self._loop: asyncio.Task[None] | None = None
        self._started = False
        self._tending = asyncio.Lock()
        """Held by one tend and by a reload's emptying: never both ending one sandbox."""
        self.refilling = True
        """False once the relay drains: no new create starts (expiry goes on)."""

    def _pools_of(self, catalog: Catalog) -> dict[tuple[str, str], Pool]:
        """The catalog's pools; :attr:`skipped` becomes its skipped ones (each logged
        when it first is: at the start, or by the reload that makes it one)."""
        pools, skipped = {}, {}
        for job in catalog.jobs.values():
            pool = self._pool_for(job)
            if isinstance(pool, Skipped):
                skipped[job.name] = pool
                if self.skipped.get(job.name) != pool:
                    log.warning(
                        "no warm pool: %s",
                        pool.reason,
                        extra={"job": job.name, "provider": pool.provider},
                    )
            elif pool is not None:
                pools[(pool.shape.job, pool.shape.provider)] = pool
        self.skipped = skipped
        return pools

    def _pool_for(self, job: JobSpec) -> Pool | Skipped | None:
        target = self.settings.pool_warm.get(job.name, job.warm)
        # On the first provider of the job's route (a route claims a warm sandbox on any of
        # its providers before a cold create anywhere: relay/runs/route.py).
        name = (job.route_names or tuple(self.settings.default_route))[0]
        provider = self.providers.get(name)
        if target <= 0 or self.settings.pool_max <= 0:
            return None
        if not isinstance(provider, SandboxProvider):
            log.warning("no warm pool: provider not enabled", extra={"job": job.name})
            return None
        if provider.skips_warm_pools is not None:
            return Skipped(job.name, name, provider.skips_warm_pools)
        cpu, memory_mb, disk_mb = SIZES[job.size]
        timeout_s = min(job.timeout_s, self.settings.max_timeout_s)
        pool = Pool(
            shape=Shape(
                job.name,
                name,
                image_for(name, None, job, job.image),
                Resources(cpu=cpu, memory_mb=memory_mb, disk_mb=disk_mb),
                Egress(job.egress),
                job.pip,
            ),
            target=target,
            provider=provider,
            timeout_s=timeout_s,
            usd_per_s=self.costs.cost(name, cpu, memory_mb, 1.0),
        )
        try:
            provider.check(self.spec(pool, f"{POOL_PREFIX}check"))
        except ProviderError as exc:
            log.warning("no warm pool: %s", exc.message, extra={"job": job.name})
            return None
        return pool

    def spec(self, pool: Pool, pool_id: str) -> SandboxSpec:
        """A pooled sandbox's spec: its hard lifetime covers its idle time and grace, and
        the job's timeout unless the provider extends the lifetime at claim."""
        extends = pool.provider.extends_lifetime
        idle_s = self.settings.pool_idle_s
        shape = pool.shape
        return SandboxSpec(
            run_id=pool_id,
            cluster=self.settings.cluster,
            timeout_s=idle_s if extends else idle_s + pool.timeout_s,
            grace_s=self.settings.grace_s,
            image=shape.image,
            resources=shape.resources,
            egress=shape.egress,
            pip=shape.pip,
            job=shape.job,
        )

    def serve(self, provider: str) -> bool:
        """Whether ``provider`` has a warm pool here (for some job)."""
        return any(shape_provider == provider for _, shape_provider in self.pools)

    @property
    def size(self) -> int:
        return sum(pool.target for pool in self.pools.values())

    @property
    def ready(self) -> int:
        return sum(len(pool.ready) for pool in self.pools.values())

    # -- claims ------------------------------------------------------------------------

    def has_ready(self, provider: str, spec: SandboxSpec) -> bool:
        """Whether :meth:`claim` may find a ready sandbox for ``spec`` on ``provider`` (a
        read of this replica's memory)."""
        shape = Shape.of(provider, spec)
        pool = self.pools.get((shape.job, provider)) if shape is not None else None
        return pool is not None and bool(pool.ready) and shape == pool.shape

    async def claim(self, provider: str, spec: SandboxSpec) -> Claimed | None:
        """A ready sandbox of the spec's exact shape on ``provider``, now the spec's run's;
        None: cold."""
        shape = Shape.of(provider, spec)
        pool = self.pools.get((shape.job, provider)) if shape is not None else None
        if pool is None or not pool.ready or shape != pool.shape:
            return None
        if spec.timeout_s > pool.timeout_s and not pool.provider.extends_lifetime:
            return None  # planned for a longer job than this pool's lifetime covers (a reload)
        now = self.clock()
        claiming = asyncio.ensure_future(
            self.rows.claim(self.instance_id, pool.shape.key, spec.run_id, now, pool.usd_per_s)
        )
        try:
            record = await asyncio.shield(claiming)
        except asyncio.CancelledError:
            # The claim may be written all the same (the cancel came with the store's
            # answer): that sandbox would stay in the ready ones, its row claimed, never
            # claimed again, expired nor drained, and the pool one short for good.
            await shielded(self._unclaim(pool, claiming, now))
            raise
        except Exception as exc:  # the store refused: the cold path needs no claim
            log.warning(
                "claiming a pooled sandbox failed", extra={"error_class": type(exc).__name__}
            )
            return None
        if record is None:
            return None
        ready = pool.ready.pop(record.id, None)
        self._wake.set()
        self._count_idle(record.created_at, now, pool)
        self.stats.claimed += 1
        if ready is None:
            # Its idle time ran out while the claim was written: the expiry ended the
            # sandbox but could not end the claimed row; the run goes cold.
            with contextlib.suppress(Exception):
                await shielded(self.rows.end(record.id, now, 0.0, states=(CLAIMED,)))
            return None
        claimed = Claimed(self, pool, record, ready.box)
        if pool.provider.extends_lifetime:
            try:
                lifetime = math.ceil(spec.timeout_s + self.settings.grace_s)
                # Bounded (nothing else ends a run of this replica still starting: the
                # reaper leaves the runs a relay holds).
                await pool.provider.extended(ready.box.id, lifetime)
            except BaseException as exc:
                # No longer the pool's, not yet the run's (the extension failed, or the run
                # was canceled meanwhile): nobody else would end it.
                with contextlib.suppress(ProviderError):
                    await shielded(claimed.discard())
                if not isinstance(exc, ProviderError):
                    raise
                log.warning("extending a pooled sandbox failed; cold path", extra={"job": spec.job})
                return None
        return claimed

    async def _unclaim(
        self, pool: Pool, claiming: asyncio.Future[PoolRecord | None], now: float
    ) -> None:
        """End the sandbox a claim canceled by its run took, if the claim was written."""
        with contextlib.suppress(Exception):  # not written, or the store refused: the pool's
            record = await claiming
            ready = pool.ready.pop(record.id, None) if record is not None else None
            if record is None or ready is None:
                return
            self._wake.set()
            self._count_idle(record.created_at, now, pool)
            await Claimed(self, pool, record, ready.box).discard()

    def _count_idle(self, created_at: float, until: float, pool: Pool) -> None:
        seconds = max(0.0, until - created_at)
        self.stats.idle_s += seconds
        self.stats.idle_usd += seconds * pool.usd_per_s

    # -- the refill loop ---------------------------------------------------------------

    def start(self) -> None:
        """Fill the pools, and keep them full, in the background."""
        self._started = True
        if self.pools and self._loop is None and self.refilling:
            self._loop = asyncio.create_task(self._tend_forever(), name="warm-pools")

    async def _tend_forever(self) -> None:
        while True:
            try:
                await self.tend()
            except Exception as exc:
                log.warning(
                    "tending the warm pools failed", extra={"error_class": type(exc).__name__}
                )
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(TICK_S, self.settings.pool_idle_s / 4)):
                    await self._wake.wait()

    async def tend(self) -> None:
        """End the sandboxes idle past their time, then start creates where there is room."""
        async with self._tending:
            await self._expire()
        if not self.refilling:
            return
        room = self.settings.pool_max - await self.rows.waiting()
        now = time.monotonic()
        for pool in self.pools.values():
            if now < pool.retry_at:
                continue
            wanted = pool.target - len(pool.ready) - pool.creating
            count = min(wanted, room, REFILL_CONCURRENCY - len(self._filling))
            for _ in range(max(0, count)):
                pool.creating += 1
                task = asyncio.create_task(self._fill_one(pool))
                self._filling.add(task)
                task.add_done_callback(self._filling.discard)
            room -= max(0, count)

    async def _fill_one(self, pool: Pool) -> None:
        pool_id = POOL_PREFIX + secrets.token_hex(12)
        now = self.clock()
        expires_at = now + self.settings.pool_idle_s
        try:
            record = self._record(pool, pool_id, now, expires_at)
            if not await self.rows.add(record, self.settings.pool_max):
                return  # other replicas filled the room meanwhile: nothing was created
            try:
                box = await pool.provider.created(self.spec(pool, pool_id))
            except BaseException:
                with contextlib.suppress(Exception):
                    await shielded(self.rows.end(pool_id, self.clock(), pool.usd_per_s))
                raise
        except Exception as exc:
            pool.failures += 1
            self.stats.failed += 1
            first, longest = BACKOFF_S
            pool.retry_at = time.monotonic() + min(first * 2 ** (pool.failures - 1), longest)
            log.warning(
                "creating a pooled sandbox failed",
                extra={"job": pool.shape.job, "error_class": type(exc).__name__},
            )
            return
        finally:
            pool.creating -= 1
        pool.failures = 0
        self.stats.created += 1
        # Shielded: a drain that cancels this fill now must find the sandbox among the
        # ready ones (or see it ended), not leave it running behind the relay.
        await shielded(self._keep(pool, pool_id, box, now, expires_at))

    async def _keep(
        self, pool: Pool, pool_id: str, box: ProviderSandbox, now: float, expires_at: float
    ) -> None:
        try:
            marked = await self.rows.mark_ready(pool_id, box.id)
        except Exception:
            marked = False  # the store refused: a sandbox nobody can claim
            with contextlib.suppress(Exception):
                await self.rows.end(pool_id, self.clock(), pool.usd_per_s)
        if marked and not pool.retired:
            pool.ready[pool_id] = _Ready(box, now, expires_at)
            return
        if marked:  # its pool went with a jobs reload meanwhile: no run will claim it
            with contextlib.suppress(Exception):  # else the reaper ends the row
                await self.rows.end(pool_id, self.clock(), pool.usd_per_s, states=(READY,))
            self._count_idle(now, self.clock(), pool)
        await self._end(pool, pool_id, box)  # ended meanwhile: nobody will claim it

    def _record(self, pool: Pool, pool_id: str, now: float, expires_at: float) -> PoolRecord:
        shape = pool.shape
        return PoolRecord(
            id=pool_id,
            shape=shape.key,
            job=shape.job,
            provider=shape.provider,
            holder=self.instance_id,
            state=CREATING,
            cpu=shape.resources.cpu,
            memory_mb=shape.resources.memory_mb,
            created_at=now,
            expires_at=expires_at,
        )

    async def _expire(self) -> None:
        now = self.clock()
        for pool in self.pools.values():
            for pool_id, ready in list(pool.ready.items()):
                if ready.expires_at > now:
                    continue
                if await self.rows.end(pool_id, now, pool.usd_per_s, states=(READY,)):
                    pool.ready.pop(pool_id, None)
                    self.stats.expired += 1
                    self._count_idle(ready.created_at, now, pool)
                    await self._end(pool, pool_id, ready.box)
                elif pool.ready.pop(pool_id, None) is not None:
                    # Its row is no longer ready, yet no run took it from here (a claim
                    # written, then answered with an error; the reaper): nobody serves it,
                    # and kept it would stay alive and leave the pool one short for good.
                    await self._end(pool, pool_id, ready.box)

    async def _end(self, pool: Pool, pool_id: str, box: ProviderSandbox) -> None:
        with contextlib.suppress(ProviderError):  # logged; the reaper retries it
            await shielded(pool.provider.terminate(box.id))

    # -- shutdown ----------------------------------------------------------------------

    async def drain(self) -> None:
        """Stop refilling and terminate every ready sandbox of this replica."""
        self.refilling = False
        tasks = [task for task in (self._loop, *self._filling) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loop = None
        async with self._tending:  # after a jobs reload's emptying, if one is under way
            ended = await self._empty(self.pools.values())
        if ended:
            log.info("warm pools drained", extra={"terminated": ended})

    async def _empty(self, pools: Iterable[Pool], keep: int = 0) -> int:
        """Terminate the ready sandboxes of ``pools``, all but the ``keep`` newest of each;
        how many."""
        now = self.clock()
        ending = []
        for pool in pools:
            ready_ones = list(pool.ready.items())  # oldest first
            for pool_id, ready in ready_ones[: max(0, len(ready_ones) - keep)]:
                try:
                    ended = await self.rows.end(pool_id, now, pool.usd_per_s, states=(READY,))
                except Exception as exc:
                    # The store is away (a database restarting, a full disk): the sandbox
                    # is ended all the same, none outlives its pool; the reaper ends its
                    # row once the store is back.
                    log.warning(
                        "ending a pooled sandbox's row failed; terminating it",
                        extra={"pool_id": pool_id, "error_class": type(exc).__name__},
                    )
                    ended = False
                if ended:
                    pool.ready.pop(pool_id, None)
                    self._count_idle(ready.created_at, now, pool)
                    ending.append(self._end(pool, pool_id, ready.box))
                elif pool.ready.pop(pool_id, None) is not None:  # nobody serves it (_expire)
                    ending.append(self._end(pool, pool_id, ready.box))
        await asyncio.gather(*ending)
        return len(ending)

    # -- a jobs reload -----------------------------------------------------------------

    async def follow(self, catalog: Catalog) -> None:
        """Make the pools the reloaded catalog's: a pool whose job keeps its shape (and
        timeout) keeps its sandboxes, with its new size (the ready ones past it are
        terminated); one whose job changed shape or went away is retired and its ready
        sandboxes terminated (those still being created are, once made); a new one fills
        from the next tend. Runs planned before keep what they claimed."""
        wanted = self._pools_of(catalog)
        kept: dict[tuple[str, str], Pool] = {}
        retired = [pool for key, pool in self.pools.items() if key not in wanted]
        for key, pool in wanted.items():
            old = self.pools.get(key)
            if old is not None and old.serves_as(pool):
                old.target = pool.target
                kept[key] = old
            else:
                kept[key] = pool
                if old is not None:
                    retired.append(old)
        self.pools = kept  # before any await: a claim from now on finds the new pools
        for pool in retired:
            pool.retired = True
        async with self._tending:
            ended = await self._empty(retired)
            for pool in kept.values():
                ended += await self._empty([pool], keep=pool.target)
        if retired or ended:
            log.info(
                "warm pools follow the reloaded jobs",
                extra={"retired": len(retired), "terminated": ended},
            )
        self._wake.set()
        if self._started:
            self.start()
