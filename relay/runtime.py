"""The composition root: one relay process's parts, built in order, started, ended in order.

:meth:`Relay.open` builds the store, the providers, the event bus, the run service (which
makes its runner, warm pools and sandbox sources), the reaper, the webhook dispatcher, the
pruner and the token-use writer; :meth:`Relay.start` begins their background work; leaving
``open`` ends it all, in this order:

The job catalog is held by :class:`~relay.runs.jobs_folder.JobsFolder`: :meth:`Relay.reload_jobs`
(``SIGHUP``, ``POST /v1/jobs/reload``, or ``RELAY_JOBS_WATCH_S``) swaps it whole, and the
warm pools follow.

1. the runs drain (the service: no new run, those running get ``RELAY_DRAIN_S`` to end,
   the rest are canceled and written final; the warm pools terminate their sandboxes);
2. what the caller serves beside the relay closes, last entered first (the HTTP layer's MCP
   sessions, after the drain so that a tool call whose run finished meanwhile has its
   answer; its live run streams);
3. the webhook dispatcher, the pruner, the token-use writer (its last uses written) and the
   jobs folder's watch stop,
   and the dispatcher's client closes;
4. the reaper stops, mid-sweep if it must (the next process's sweep does the rest);
5. this replica's heartbeat row goes, so the others need not wait to judge it dead;
6. the cleanup the providers do beside serving gets a few seconds to end (a terminate a
   run's answer did not wait for), then their clients close, then the store.

The HTTP app's lifespan is one ``async with Relay.open(...)`` (relay/http/app.py); the
benchmarks enter it the same way. Nothing here knows HTTP: what the app adds (metrics, the
run streams, ``/mcp``) it attaches to the parts, or serves beside them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass, field

from relay.auth import TokenStore
from relay.errors import ConfigError
from relay.providers.contract import Provider
from relay.providers.lifecycle import SandboxProvider
from relay.providers.registry import load_providers
from relay.runs.catalog import Catalog
from relay.runs.event_bus import EventBus
from relay.runs.jobs_folder import JobsFolder, Reload
from relay.runs.pools import Pools
from relay.runs.reaper import Reaper
from relay.runs.service import RunService
from relay.settings import Settings
from relay.store.database import Store
from relay.store.objects import Objects, open_objects
from relay.store.retention import Pruner
from relay.store.token_uses import TokenUseWriter
from relay.webhooks.dispatcher import WebhookDispatcher

log = logging.getLogger("relay.runtime")

Beside = AbstractAsyncContextManager[object] | AbstractContextManager[object]
"""Something a caller serves beside the relay: entered at start, closed after the drain."""


def check_start(settings: Settings, catalog: Catalog) -> None:
    """Refuse at once what would otherwise fail, or go wrong unseen, once serving: a
    ``RELAY_POOL_WARM`` naming no job, an untrusted sandbox root for ``local``."""
    unknown = sorted(set(settings.pool_warm) - set(catalog.jobs))
    if unknown:  # a misspelt job would have no pool, and no one told
        raise ConfigError(
            f"RELAY_POOL_WARM: no job named {unknown[0]!r}; jobs here: {', '.join(catalog.jobs)}"
        )
    if "local" in settings.providers:
        from relay.providers.local.root import check_root, sandbox_root

        check_root(sandbox_root(settings))  # refuse an untrusted root before serving


@dataclass
class Relay:
    """One relay process: its parts, their background work, and its ordered shutdown."""

    settings: Settings
    tokens: TokenStore
    catalog: Catalog
    store: Store
    providers: dict[str, Provider]
    events: EventBus
    service: RunService
    reaper: Reaper
    webhooks: WebhookDispatcher
    pruner: Pruner
    token_uses: TokenUseWriter
    """Notes when each token value was last used, a minute at a time (not once a request)."""
    jobs: JobsFolder
    """The catalog's folder: reloads swap the catalog whole, the warm pools follow."""
    _reaping: asyncio.Task[None] | None = field(default=None, init=False, repr=False)
    _background: list[asyncio.Task[None]] = field(default_factory=list, init=False, repr=False)
    """The dispatcher's, the pruner's, the token uses' and the jobs folder watch's tasks."""
    _beside: contextlib.AsyncExitStack = field(
        default_factory=contextlib.AsyncExitStack, init=False, repr=False
    )

    @property
    def pools(self) -> Pools:
        return self.service.pools

    @property
    def instance_id(self) -> str:
        return self.service.instance_id

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls,
        settings: Settings,
        *,
        tokens: TokenStore | None = None,
        catalog: Catalog | None = None,
        providers: Mapping[str, Provider] | None = None,
        instance_id: str | None = None,
    ) -> AsyncIterator[Relay]:
        """The relay's parts, built (not started: :meth:`start`), and ended in order on
        leaving. ``tokens`` and ``catalog`` default to the settings' files; ``providers``
        to the enabled ones, built here (either way they are closed here)."""
        tokens = tokens if tokens is not None else TokenStore(settings.tokens_file)
        catalog = catalog if catalog is not None else Catalog.load(settings.jobs_dir)
        store = await Store.open(settings.database_url)
        built: dict[str, Provider] = {}
        try:
            objects = await open_objects(settings)
            built = dict(providers) if providers is not None else load_providers(settings)
            relay = cls._assemble(settings, tokens, catalog, store, built, instance_id, objects)
        except BaseException:
            await _close_providers(built if providers is None else dict(providers))
            await store.close()
            raise
        try:
            yield relay
        finally:
            await relay._end()

    @classmethod
    def _assemble(
        cls,
        settings: Settings,
        tokens: TokenStore,
        catalog: Catalog,
        store: Store,
        providers: dict[str, Provider],
        instance_id: str | None,
        objects: Objects | None = None,
    ) -> Relay:
        events = EventBus()
        service = RunService(
            settings,
            store,
            catalog,
            providers,
            instance_id=instance_id,
            events=events,
            objects=objects,
        )
        reaper = Reaper(
            store,
            providers,
            settings,
            holds=service.holds,
            instance_id=service.instance_id,
            events=events,
            grace_s=settings.grace_s,
            single_replica=store.is_sqlite,
            reap_interval_s=settings.reap_interval_s,
            before_sweep=service.replay_spool,
            beat=lambda: service.breakers.snapshot(providers),
        )
        webhooks = WebhookDispatcher(
            settings, store, secret_for=tokens.webhook_secret, events=events
        )
        pruner = Pruner(
            store,
            retention_days=settings.retention_days,
            interval_s=settings.prune_interval_s,
            objects=objects,
        )
        token_uses = TokenUseWriter(store, tokens.take_uses)
        jobs = JobsFolder(settings, catalog)
        jobs.follow(service.pools.follow)
        return cls(
            settings,
            tokens,
            catalog,
            store,
            providers,
            events,
            service,
            reaper,
            webhooks,
            pruner,
            token_uses,
            jobs,
        )

    async def reload_jobs(self) -> Reload:
        """Read the jobs folder again and serve it if it loads, else raise JobsInvalid (the
        last good jobs serve on); the warm pools and the other followers are told."""
        return await self.jobs.reload()

    async def start(self, *beside: Beside) -> None:
        """Write this replica's first heartbeat, replay the spool (the outcomes a relay
        that stopped with the store down left: written, or held, before any reaper may mark
        those runs lost), then start the background work beside serving: the reaper (its
        first sweep at once: hundreds of orphans must not keep the relay from answering),
        the warm pools' fill, the webhook dispatcher, the pruner. ``beside`` is entered
        last, and closed right after the runs drain."""
        await self.store.heartbeat(self.instance_id, self.service.breakers.snapshot(self.providers))
        await self.service.replay_spool()
        self._reaping = asyncio.create_task(self.reaper.run_forever(sweep_first=True))
        self.service.start()
        self._background += [
            asyncio.create_task(self.webhooks.run_forever()),
            asyncio.create_task(self.pruner.run_forever()),
            asyncio.create_task(self.token_uses.run_forever()),
        ]
        if self.settings.jobs_watch_s > 0:
            watch = self.jobs.watch_forever(self.settings.jobs_watch_s)
            self._background.append(asyncio.create_task(watch))
        for context in beside:
            if isinstance(context, AbstractAsyncContextManager):
                await self._beside.enter_async_context(context)
            else:
                self._beside.enter_context(context)

    async def _end(self) -> None:
        """The ordered shutdown (the module's docstring says why this order)."""
        await self.service.shutdown()
        await self._beside.aclose()
        for task in self._background:
            await _stopped(task)
        with contextlib.suppress(Exception):  # the last minute's token uses
            await self.token_uses.write()
        await self.webhooks.aclose()
        if self._reaping is not None:
            await _stopped(self._reaping)
        with contextlib.suppress(Exception):
            await self.store.forget_replica(self.instance_id)
        await _close_providers(self.providers)
        await self.store.close()


async def _stopped(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _close_providers(providers: Mapping[str, Provider]) -> None:
    # First the cleanup no caller waited for (a sweep, a terminate past its wait), a few
    # seconds at most; what is left of it is the next sweep's (relay/providers/aftercare.py).
    aftercare = [p.aftercare for p in providers.values() if isinstance(p, SandboxProvider)]
    await asyncio.gather(*(each.finish() for each in aftercare), return_exceptions=True)
    for provider in providers.values():
        with contextlib.suppress(Exception):
            await provider.aclose()
