"""Prometheus metrics, served at ``GET /metrics``, one registry per app.

Each app gets its own :class:`prometheus_client.CollectorRegistry` (never the global
one), so two apps in one process, or one test after another, never share a counter.

Labels are low-cardinality by construction: a route is its path *template*
(``/v1/runs/{run_id}``), a method outside the usual seven reads ``other``, a job is a
name declared in ``jobs/`` (``(command)`` for a raw argv), a provider is an enabled
provider's name. No run id, token, header or other caller input is ever a label.

The series (names are stable API; dashboards depend on them):

==========================================  =========  ===============================
``relay_http_requests_total``               counter    method, route, status
``relay_http_request_duration_seconds``     histogram  method, route
``relay_runs_total``                        counter    job, provider, state (final)
``relay_run_duration_seconds``              histogram  provider (a run's duration_ms)
``relay_sandbox_create_seconds``            histogram  provider (a run's create_ms)
``relay_spend_usd_total``                   counter    provider (a run's cost_usd)
``relay_runs_in_flight``                    gauge      (runs held by this process)
``relay_reaper_terminations_total``         counter    reason (sandboxes the reaper ended)
``relay_reaper_unknown_age_total``           counter    (unknown sandboxes with no age: left)
``relay_reaper_failures_total``             counter    (terminates that failed)
``relay_reaper_failing_sandboxes``          gauge      (still failing, retried each sweep)
``relay_webhook_deliveries_total``          counter    outcome
``relay_local_cleanup_failures_total``      counter    (local sandbox cleanups that failed)
``relay_pruned_rows_total``                 counter    table (runs, deliveries)
``relay_pool_size``                         gauge      (warm pool sandboxes wanted, all jobs)
``relay_pool_ready``                        gauge      (pooled sandboxes ready now)
``relay_pool_sandboxes_total``              counter    event (created, claimed, expired, failed)
``relay_pool_idle_seconds_total``           counter    (seconds pooled sandboxes waited)
``relay_pool_idle_usd_total``               counter    (what that idle time cost)
``relay_provider_breaker_state``            gauge      provider (0 closed, 1 half-open, 2 open)
``relay_route_attempts_total``              counter    provider, code (``ok`` or the error)
``relay_route_failovers_total``             counter    provider, code (runs moved on after it)
``relay_store_bytes``                       gauge      (SQLite file pages, or PG database)
``relay_build_info``                        gauge      version, python (always 1)
``process_*``                               various    (this process: CPU, memory, fds)
==========================================  =========  ===============================

Run metrics come from the ``finished`` event: the run service publishes it for each run
it ends, and the reaper for each run it marks ``lost`` (on the replica that swept). The
in-flight and reaper numbers are read from the service and the reaper when scraped. The
pruned rows and the store's size are the retention pass's (relay/store/retention.py: each
pass on this replica, and the size after it). The webhook dispatcher reports each
delivery attempt through
``on_attempt=metrics.webhook_delivered``. The app's :class:`Metrics` is
``app.state.metrics``.
"""

from __future__ import annotations

import hmac
import json
import platform
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Gauge, ProcessCollector, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response

from relay import __version__
from relay.errors import Unauthorized
from relay.http.metric_counts import CountedFamilies, CountedHistogram, CountedTotal, Labels
from relay.runs.event_bus import EventBus, RunEvent

if TYPE_CHECKING:
    from relay.runs.reaper import Reaper
    from relay.runs.service import RunRecord, RunService
    from relay.runtime import Relay
    from relay.store.retention import Pruner

METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})
COMMAND_JOB = "(command)"
"""The ``job`` label of a raw-argv run (no declared job can have this name)."""
UNMATCHED_ROUTE = "(unmatched)"
"""The ``route`` label of a request that matched no route (a 404)."""

_REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_RUN_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
_CREATE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 8, 13, 20, 30, 60)


class _LiveCollector(Collector):
    """Numbers read at scrape time from the objects that own them."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        service, reaper, pruner = self.metrics.service, self.metrics.reaper, self.metrics.pruner
        yield GaugeMetricFamily(
            "relay_runs_in_flight",
            "Runs this process is running now (queued, starting or running).",
            value=service.active_runs if service is not None else 0,
        )
        terminations = CounterMetricFamily(
            "relay_reaper_terminations",
            "Sandboxes the reaper terminated, by reason (run_final, run_expired, "
            "run_orphaned, unknown_expired, probe_expired, pool_orphaned, pool_ended, "
            "pool_unknown_expired, abandoned).",
            labels=("reason",),
        )
        for reason, count in sorted((reaper.terminated_by_reason if reaper else {}).items()):
            terminations.add_metric((reason,), count)
        yield terminations
        yield CounterMetricFamily(
            "relay_reaper_unknown_age",
            "Sandboxes of no known run left alone because the provider gave no creation time.",
            value=reaper.unknown_age_total if reaper is not None else 0,
        )
        yield CounterMetricFamily(
            "relay_reaper_failures",
            "Terminate calls by the reaper that failed (each is retried on the next sweep).",
            value=reaper.failures_total if reaper is not None else 0,
        )
        yield GaugeMetricFamily(
            "relay_reaper_failing_sandboxes",
            "Sandboxes whose terminate is failing now; /readyz is degraded while above 0.",
            value=len(reaper.failing) if reaper is not None else 0,
        )
        local = service.providers.get("local") if service is not None else None
        yield CounterMetricFamily(
            "relay_local_cleanup_failures",
            "Local sandboxes whose cleanup (cgroup, folder) failed; the reaper retries them.",
            value=getattr(local, "cleanup_failures", 0),
        )
        pruned = CounterMetricFamily(
            "relay_pruned_rows",
            "Rows deleted by retention (RELAY_RETENTION_DAYS) on this replica, by table.",
            labels=("table",),
        )
        pruned.add_metric(("runs",), pruner.pruned_runs if pruner is not None else 0)
        pruned.add_metric(("deliveries",), pruner.pruned_deliveries if pruner is not None else 0)
        yield pruned
        yield from _pool_metrics(service)
        yield from _route_metrics(service)
        yield GaugeMetricFamily(
            "relay_store_bytes",
            "Size of the store after the last retention pass (SQLite pages, or PostgreSQL).",
            value=pruner.store_bytes if pruner is not None else 0,
        )


def _pool_metrics(service: RunService | None) -> Iterable[Metric]:
    """This replica's warm pools (relay/runs/pools.py), read when scraped."""
    pools = service.pools if service is not None else None
    yield GaugeMetricFamily(
        "relay_pool_size",
        "Warm pool sandboxes this replica keeps ready, all jobs (their warm = N).",
        value=pools.size if pools is not None else 0,
    )
    yield GaugeMetricFamily(
        "relay_pool_ready",
        "Pooled sandboxes ready for a run on this replica now.",
        value=pools.ready if pools is not None else 0,
    )
    events = CounterMetricFamily(
        "relay_pool_sandboxes",
        "Pooled sandboxes by event: created, claimed (by a run), expired (idle past "
        "RELAY_POOL_IDLE_S, replaced), failed (creates).",
        labels=("event",),
    )
    for event in ("created", "claimed", "expired", "failed"):
        events.add_metric((event,), getattr(pools.stats, event) if pools is not None else 0)
    yield events
    yield CounterMetricFamily(
        "relay_pool_idle_seconds",
        "Seconds pooled sandboxes waited for a run (billed by the provider).",
        value=pools.stats.idle_s if pools is not None else 0.0,
    )
    yield CounterMetricFamily(
        "relay_pool_idle_usd",
        "What pooled sandboxes' idle time cost, in US dollars (RELAY_COST_RATES).",
        value=pools.stats.idle_usd if pools is not None else 0.0,
    )


def _route_metrics(service: RunService | None) -> Iterable[Metric]:
    """This replica's breakers (relay/runs/breakers.py) and what routes tried, when scraped.
    Only runs whose route has several providers go through a breaker."""
    known = service.breakers.known(service.providers) if service is not None else {}
    breakers = service.breakers if service is not None else None
    states = GaugeMetricFamily(
        "relay_provider_breaker_state",
        "Each provider's breaker on this replica: 0 closed, 1 half-open (one run may try "
        "it), 2 open (routes skip it).",
        labels=("provider",),
    )
    attempts = CounterMetricFamily(
        "relay_route_attempts",
        "Attempts of routes of several providers on each provider, by outcome (ok, or the "
        "error code).",
        labels=("provider", "code"),
    )
    failovers = CounterMetricFamily(
        "relay_route_failovers",
        "Runs that moved on from a provider to the next of their route, by the error code.",
        labels=("provider", "code"),
    )
    for name, breaker in sorted(known.items()):
        assert breakers is not None
        states.add_metric((name,), breakers.state(name).number)
        for code, count in sorted(breaker.attempts.items()):
            attempts.add_metric((name, code), count)
        for code, count in sorted(breaker.failovers.items()):
            failovers.add_metric((name, code), count)
    yield states
    yield attempts
    yield failovers


class Metrics:
    """The relay's metrics; made by ``create_app``, fed by middleware and run events."""

    def __init__(self, token: str | None = None) -> None:
        disable_created_metrics()  # type: ignore[no-untyped-call]  # *_created: noise
        self.registry = CollectorRegistry(auto_describe=True)
        self.token = token
        self.service: RunService | None = None
        self.reaper: Reaper | None = None
        self.pruner: Pruner | None = None
        self._request_labels: dict[tuple[str, str, int], tuple[Labels, Labels]] = {}
        # Counted on the event loop without prometheus_client's locks and children, as
        # these classes would write them (relay/http/metric_counts.py); registered first,
        # so they lead the text as they did.
        self.requests = CountedTotal(
            "relay_http_requests",
            "HTTP requests answered, by method, route template and status.",
            ("method", "route", "status"),
        )
        self.request_seconds = CountedHistogram(
            "relay_http_request_duration_seconds",
            "Time to answer an HTTP request (a waiting POST holds until its run ends).",
            ("method", "route"),
            _REQUEST_BUCKETS,
        )
        self.runs = CountedTotal(
            "relay_runs",
            "Runs that reached a final state, by job, provider and state.",
            ("job", "provider", "state"),
        )
        self.run_seconds = CountedHistogram(
            "relay_run_duration_seconds",
            "Run duration from sandbox start to end (the run's duration_ms).",
            ("provider",),
            _RUN_BUCKETS,
        )
        self.create_seconds = CountedHistogram(
            "relay_sandbox_create_seconds",
            "Time the provider took to create a sandbox (the run's timings.create_ms).",
            ("provider",),
            _CREATE_BUCKETS,
        )
        self.spend = CountedTotal(
            "relay_spend_usd",
            "Estimated provider spend in US dollars (the finished runs' cost_usd).",
            ("provider",),
        )
        self.webhook_deliveries = CountedTotal(
            "relay_webhook_deliveries",
            "Webhook (callback) delivery attempts, by outcome.",
            ("outcome",),
        )
        self.registry.register(
            CountedFamilies(
                (
                    self.requests,
                    self.request_seconds,
                    self.runs,
                    self.run_seconds,
                    self.create_seconds,
                    self.spend,
                    self.webhook_deliveries,
                )
            )
        )
        self.registry.register(_LiveCollector(self))
        # The process's CPU, memory, open files and start time, read from /proc at scrape
        # time (nothing on a system without /proc); the usual names: process_*.
        ProcessCollector(registry=self.registry)
        build = Gauge(
            "relay_build_info",
            "Always 1; the labels say which relay and Python answer.",
            ("version", "python"),
            registry=self.registry,
        )
        build.labels(version=__version__, python=platform.python_version()).set(1)

    def attach(
        self,
        service: RunService,
        reaper: Reaper | None,
        events: EventBus,
        providers: Iterable[str],
    ) -> Callable[[], None]:
        """Follow this app's runs; returns the unsubscribe function."""
        self.service, self.reaper = service, reaper
        for name in providers:  # so every enabled provider shows, at zero, from the start
            self.spend.show((name,))
            self.run_seconds.show((name,))
            self.create_seconds.show((name,))
        return events.subscribe(self.on_event, ("finished",))

    def follow(self, relay: Relay) -> None:
        """Follow a relay's runs, reaper, webhooks and pruner (before it starts: its first
        sweep's lost runs are counted)."""
        self.attach(relay.service, relay.reaper, relay.events, relay.providers)
        self.pruner = relay.pruner
        relay.webhooks.on_attempt = self.webhook_delivered

    def on_event(self, event: RunEvent) -> None:
        if event.kind != "finished" or event.run is None:
            return
        self.record_run(event.run)

    def record_run(self, run: RunRecord) -> None:
        """Count one finished run."""
        provider = (run.provider,)
        self.runs.inc((run.job or COMMAND_JOB, run.provider, run.state))
        if run.duration_ms is not None:
            self.run_seconds.observe(provider, run.duration_ms / 1000)
        try:
            timings = json.loads(run.timings or "{}")
        except ValueError:
            timings = {}
        if isinstance(timings, dict) and timings.get("create_ms") is not None:
            self.create_seconds.observe(provider, timings["create_ms"] / 1000)
        cost = run.cost_usd or 0.0
        if cost > 0:
            self.spend.inc(provider, cost)

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        labels = self._request_labels.get((method, route, status))
        if labels is None:
            labels = self._labels_of(method, route, status)
        self.requests.inc(labels[0])
        self.request_seconds.observe(labels[1], seconds)

    def _labels_of(self, method: str, route: str, status: int) -> tuple[Labels, Labels]:
        """A request's two label tuples (its count's, its duration's), kept per method,
        route template and status when the method is one of the usual seven: every key is
        then the relay's own (a route, a status it answered), so the table stays as small
        as its routes; a method of a client's making is labelled ``other`` afresh."""
        label = method if method in METHODS else "other"
        labels = ((label, route, str(status)), (label, route))
        if label is method:
            self._request_labels[(method, route, status)] = labels
        return labels

    def webhook_delivered(self, outcome: str) -> None:
        """Count one webhook delivery attempt; ``outcome`` is a fixed word such as
        ``delivered``, ``retrying`` or ``failed``, never a URL or a status text."""
        self.webhook_deliveries.inc((outcome,))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def check_access(self, request: Request) -> None:
        """With ``RELAY_METRICS_TOKEN`` set, a scrape must send it as a bearer token."""
        if self.token is None:
            return
        scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
        given = credentials.strip().encode()
        if scheme.lower() != "bearer" or not hmac.compare_digest(given, self.token.encode()):
            message = "use `Authorization: Bearer <RELAY_METRICS_TOKEN>`"
            if scheme.lower() == "bearer" and given:  # a token, not this one
                raise Unauthorized.token_refused(message)
            raise Unauthorized(message)


async def metrics_endpoint(request: Request) -> Response:
    """``GET /metrics``: the Prometheus text format."""
    metrics: Metrics = request.app.state.metrics
    metrics.check_access(request)
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)
