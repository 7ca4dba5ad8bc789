"""Counters and histograms counted as plain numbers, handed to prometheus_client when scraped.

prometheus_client's ``Counter`` and ``Histogram`` take a lock and go through a child object
for every increment. The relay counts each request and each finished run (six counts and
three observations a run), all on its event loop's thread: these keep a number (a counter)
or a list of bucket counts and a sum (a histogram) per tuple of label values, and give
prometheus_client the same families when ``/metrics`` is scraped. The text is the one those
classes write for the same observations: the names, HELP and TYPE lines, labels in their
order, series in the order their labels were first seen, each histogram's ``_bucket``
(cumulative, ``le`` as prometheus_client writes it), ``_count`` and ``_sum``, every number
the same float (tests/http/test_metric_counts.py compares the two texts).

Counting is not locked: everything that counts runs on the event loop's thread (the request's
end, the ``finished`` event, the webhook dispatcher's attempts). A scrape takes a copy of each
table first, so one from another thread reads numbers at most one count behind, never a table
changing under it.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

Labels = tuple[str, ...]


class CountedTotal:
    """A counter family: a total per tuple of label values (``relay_..._total``)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        self.totals: dict[Labels, float] = {}

    def inc(self, labels: Labels, amount: float = 1.0) -> None:
        """Add ``amount`` (never negative: a counter only grows) to the series of ``labels``."""
        totals = self.totals
        totals[labels] = totals.get(labels, 0.0) + amount

    def show(self, labels: Labels) -> None:
        """Write the series of ``labels`` from now on, at zero until counted."""
        self.totals.setdefault(labels, 0.0)

    def family(self) -> Metric:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, total in list(self.totals.items()):
            family.add_metric(labels, total)
        return family


class CountedHistogram:
    """A histogram family: per tuple of label values, a count per bucket (the first bucket
    whose upper bound the value does not pass, as prometheus_client places it) and a sum."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
    ) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        bounds = [float(bound) for bound in buckets]
        if bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.bounds = tuple(bounds)
        # Each bucket's ``le`` as prometheus_client writes it: "0.005", "1.0", "+Inf".
        self.edges = tuple(
            floatToGoString(bound)  # type: ignore[no-untyped-call]
            for bound in bounds
        )
        self.series: dict[Labels, list[float]] = {}
        """Per label values: each bucket's count, then the sum of the values observed."""

    def observe(self, labels: Labels, value: float) -> None:
        series = self.series.get(labels)
        if series is None:
            series = self.series[labels] = self._empty()
        series[-1] += value
        bounds = self.bounds
        index = bisect_left(bounds, value)
        if index < len(bounds) and value <= bounds[index]:  # NaN is in no bucket
            series[index] += 1

    def show(self, labels: Labels) -> None:
        """Write the series of ``labels`` from now on, empty until observed."""
        if labels not in self.series:
            self.series[labels] = self._empty()

    def _empty(self) -> list[float]:
        return [0.0] * (len(self.bounds) + 1)

    def family(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, series in list(self.series.items()):
            counts = series.copy()
            below = 0.0
            buckets: list[tuple[str, float]] = []
            for edge, count in zip(self.edges, counts, strict=False):
                below += count
                buckets.append((edge, below))
            family.add_metric(labels, buckets, counts[-1])
        return family


class CountedFamilies(Collector):
    """The families above, in the order given, as one collector of a registry."""

    def __init__(self, families: Iterable[CountedTotal | CountedHistogram]) -> None:
        self.families = tuple(families)

    def collect(self) -> Iterable[Metric]:
        for family in self.families:
            yield family.family()
