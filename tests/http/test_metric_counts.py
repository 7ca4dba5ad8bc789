"""The relay counts its request and run series as plain numbers (relay/http/metric_counts.py)
and must write the very text prometheus_client's ``Counter`` and ``Histogram`` write for the
same observations: dashboards and alerts read these names, labels, buckets and numbers.

The reference below is those classes, declared as the relay declared them before, fed the
same requests, runs and webhook attempts as ``Metrics`` counted them then."""

from __future__ import annotations

import json
import math
from typing import Any

import hypothesis
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest

from relay.http.metrics import Metrics
from relay.runs.event_bus import EventBus, RunEvent
from testing.rows import run_row

_REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_RUN_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
_CREATE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 8, 13, 20, 30, 60)


class Reference:
    """The request, run and webhook series as prometheus_client's own classes keep them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.requests = Counter(
            "relay_http_requests",
            "HTTP requests answered, by method, route template and status.",
            ("method", "route", "status"),
            registry=registry,
        )
        self.request_seconds = Histogram(
            "relay_http_request_duration_seconds",
            "Time to answer an HTTP request (a waiting POST holds until its run ends).",
            ("method", "route"),
            buckets=_REQUEST_BUCKETS,
            registry=registry,
        )
        self.runs = Counter(
            "relay_runs",
            "Runs that reached a final state, by job, provider and state.",
            ("job", "provider", "state"),
            registry=registry,
        )
        self.run_seconds = Histogram(
            "relay_run_duration_seconds",
            "Run duration from sandbox start to end (the run's duration_ms).",
            ("provider",),
            buckets=_RUN_BUCKETS,
            registry=registry,
        )
        self.create_seconds = Histogram(
            "relay_sandbox_create_seconds",
            "Time the provider took to create a sandbox (the run's timings.create_ms).",
            ("provider",),
            buckets=_CREATE_BUCKETS,
            registry=registry,
        )
        self.spend = Counter(
            "relay_spend_usd",
            "Estimated provider spend in US dollars (the finished runs' cost_usd).",
            ("provider",),
            registry=registry,
        )
        self.webhook_deliveries = Counter(
            "relay_webhook_deliveries",
            "Webhook (callback) delivery attempts, by outcome.",
            ("outcome",),
            registry=registry,
        )

    def show(self, provider: str) -> None:
        self.spend.labels(provider=provider)
        self.run_seconds.labels(provider=provider)
        self.create_seconds.labels(provider=provider)

    def request(self, method: str, route: str, status: int, seconds: float) -> None:
        method = (
            method
            if method in {"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"}
            else "other"
        )
        self.requests.labels(method, route, str(status)).inc()
        self.request_seconds.labels(method, route).observe(seconds)

    def run(self, values: dict[str, Any]) -> None:
        provider = values["provider"]
        self.runs.labels(values["job"] or "(command)", provider, values["state"]).inc()
        if values["duration_ms"] is not None:
            self.run_seconds.labels(provider).observe(values["duration_ms"] / 1000)
        try:
            timings = json.loads(values["timings"] or "{}")
        except ValueError:
            timings = {}
        if isinstance(timings, dict) and timings.get("create_ms") is not None:
            self.create_seconds.labels(provider).observe(timings["create_ms"] / 1000)
        cost = values["cost_usd"] or 0.0
        if cost > 0:
            self.spend.labels(provider).inc(cost)


_NUMBERS = (
    st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([0, 0.005, 0.0049999, 0.1, 1, 60, 3600, 3600.0001, -1, 1e300])
    | st.integers(-10, 10**12)
)
_REQUEST = st.tuples(
    st.just("request"),
    st.sampled_from(["GET", "POST", "DELETE", "PROPFIND"]),
    st.sampled_from(["/v1/runs", "/v1/runs/{run_id}", "(unmatched)"]),
    st.sampled_from([200, 201, 404, 429, 500]),
    _NUMBERS,
)
_TIMINGS = st.none() | st.sampled_from(["", "not json", "[1]", '{"create_ms": null}', "{}"])
_RUN = st.tuples(
    st.just("run"),
    st.fixed_dictionaries(
        {
            "job": st.sampled_from([None, "echo", "noop"]),
            "provider": st.sampled_from(["local", "memory", "e2b"]),
            "state": st.sampled_from(["succeeded", "failed", "timed_out", "lost"]),
            "duration_ms": st.none() | st.integers(-5, 10**8),
            "timings": _TIMINGS | _NUMBERS.map(lambda ms: json.dumps({"create_ms": ms})),
            "cost_usd": st.none() | _NUMBERS,
        }
    ),
)
_WEBHOOK = st.tuples(st.just("webhook"), st.sampled_from(["delivered", "retrying", "failed"]))


def counted(shown: list[str], events: list[tuple[Any, ...]]) -> tuple[str, str]:
    """The relay's /metrics text and the reference's, after the same observations."""
    metrics, reference, bus = Metrics(), Reference(), EventBus()
    metrics.attach(None, None, bus, shown)  # type: ignore[arg-type]  # no service: none read
    for provider in shown:
        reference.show(provider)
    for number, (kind, *what) in enumerate(events):
        if kind == "request":
            metrics.observe_request(*what)
            reference.request(*what)
        elif kind == "run":
            [values] = what
            run = run_row(f"run_{number}", **values)
            bus.publish(RunEvent(run.id, "finished", state=run.state, run=run))
            reference.run(values)
        else:
            metrics.webhook_delivered(*what)
            reference.webhook_deliveries.labels(*what).inc()
    return metrics.render().decode(), generate_latest(reference.registry).decode()


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(
    shown=st.lists(st.sampled_from(["local", "memory", "e2b"]), unique=True),
    events=st.lists(_REQUEST | _RUN | _WEBHOOK, max_size=30),
)
def test_the_counted_series_are_written_as_prometheus_client_writes_them(
    shown: list[str], events: list[tuple[Any, ...]]
) -> None:
    text, expected = counted(shown, events)
    assert text.startswith(expected)  # the same bytes, first in the text as before
    assert text[len(expected) :].startswith("# HELP relay_runs_in_flight ")


def test_every_bucket_edge_and_odd_value_lands_where_prometheus_client_puts_it() -> None:
    edges = {*_REQUEST_BUCKETS, *_RUN_BUCKETS, *_CREATE_BUCKETS}
    values = [v for edge in edges for v in (edge, math.nextafter(edge, math.inf))]
    values += [0, -0.0, -1, math.inf, -math.inf, math.nan, 1e-300, 1e300]
    events: list[tuple[Any, ...]] = []
    for value in values:
        events.append(("request", "POST", "/v1/runs", 200, value))
        timings = json.dumps({"create_ms": value * 1000})
        run = {"job": "echo", "provider": "local", "state": "succeeded", "cost_usd": value}
        events.append(("run", run | {"duration_ms": None, "timings": timings}))
        if math.isfinite(value):
            events.append(("run", run | {"duration_ms": int(value * 1000), "timings": None}))
    text, expected = counted(["local"], events)
    assert text.startswith(expected)
    assert 'le="+Inf"' in expected and "_sum{" in expected and "NaN" in expected


def test_a_requests_labels_kept_for_its_route_and_status_count_as_the_first_time_did() -> None:
    """The label tuples of a request of one of the usual seven methods are worked out once
    per route and status and kept; a method of a client's making is labelled ``other``
    each time and never kept (a client would fill the table). Either way, the text is the
    reference's, the first time and every time after."""
    requests = [
        ("POST", "/v1/runs", 201, 0.004),
        ("POST", "/v1/runs", 201, 0.2),
        ("POST", "/v1/runs", 422, 0.001),
        ("BREW", "(unmatched)", 404, 0.003),
        ("BREW", "(unmatched)", 404, 0.03),
        ("GET", "/v1/runs/{run_id}", 200, 7.0),
    ]
    text, expected = counted([], [("request", *request) for request in requests])
    assert text.startswith(expected)
    metrics = Metrics()
    for request in requests:
        metrics.observe_request(*request)
    assert sorted(metrics._request_labels) == [
        ("GET", "/v1/runs/{run_id}", 200),
        ("POST", "/v1/runs", 201),
        ("POST", "/v1/runs", 422),
    ]
    assert metrics.requests.totals[("other", "(unmatched)", "404")] == 2
    assert metrics.requests.totals[("POST", "/v1/runs", "201")] == 2
