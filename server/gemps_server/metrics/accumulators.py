"""Metric families that cost a few arithmetic operations per event, rendered when scraped (issue 57).

prometheus_client's Counter, Histogram and Summary take a lock per value, walk the bucket bounds
and look up labelled children on every event: microseconds each (ServerMetrics.applied alone was
~16% of the data plane thread's busy samples at 100K parameters). The families here add into plain
float64 arrays and build the same page at scrape time: the same names, types, help, label names
and values (children in the order they were made), bucket bounds and `_created` samples (none
after prometheus_client's disable_created_metrics(), which the server's process calls), and no
exemplars (the server records none). The server's rare events (registrations, checkpoints,
refusals, ...) keep prometheus_client's own families.

Threads: every thread that records gets its own array per family (threading.local), which only it
writes, so the applier, the event loop and the data plane's thread count the same series exactly
without a lock per event. A scrape sums the arrays; an array whose thread has ended is folded into
the family's `retired` one, so short-lived threads leave no arrays behind. The family's lock is
taken only there, when a thread records its first event and when a child is made. A scrape reading
an array while its thread adds to it sees each slot before or after that event (one float64 store);
a histogram's count is summed from its buckets, so the two always agree.

Layout, for code that records without Python (a compiled commit core, numpy): `values()` is the
calling thread's array.array("d"), float64, contiguous, never resized; hand it over through the
buffer protocol (a C function's Py_buffer, numpy.frombuffer: no copy) and add into it from that
same thread only. Child c (the index `child(*label_values)` returns; 0 without labels) occupies
slots [c * width, (c + 1) * width):
- counter: [value]                                    width 1
- summary: [count, sum]                               width 2
- histogram: [bucket 0, ..., bucket B-1, sum]         width B + 1, B = len(bounds) (the last +Inf);
  bucket i counts the v with bounds[i-1] < v <= bounds[i] (not cumulative: the scrape adds them
  up); a NaN adds to the sum only, as in prometheus_client
- gauge: one array shared by all threads, [value]; the last store wins.
Counts are float64, exact up to 2**53 events.
"""

from __future__ import annotations

import threading
import time
from array import array
from bisect import bisect_left
from collections.abc import Iterable, Sequence

import prometheus_client.metrics as prometheus_metrics
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import INF, floatToGoString

Labels = tuple[str, ...]


class Family(Collector):
    """One family's children and its threads' arrays; subclasses say what a child's slots hold.

    `children` are made at once, in order (a family without labels has the one child `()`);
    `capacity` children at most (default: as many as `children`), the rest made by `child()` when
    first recorded, so their series (and `_created`) appear then, as prometheus_client's do."""

    width = 1

    def __init__(
        self,
        registry: CollectorRegistry,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        children: Iterable[Labels] = (),
        capacity: int = 0,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        initial = list(children) if self.labelnames else [()]
        self.capacity = max(capacity, len(initial))
        self._lock = threading.Lock()
        self._labels: list[Labels] = []
        self._created: list[float] = []
        self._index: dict[Labels, int] = {}
        self._local = threading.local()
        self._threads: dict[threading.Thread, array[float]] = {}
        self._retired = self._new_array()
        for labels in initial:
            self.child(*labels)
        registry.register(self)

    # -- recording -------------------------------------------------------------------------------

    def child(self, *label_values: str) -> int:
        """The index of the child with these label values, made (its series shown) at the first call."""
        index = self._index.get(label_values)
        return self._make(label_values) if index is None else index

    def values(self) -> array[float]:
        """The calling thread's array (see the module's docstring for its layout). inc and observe
        repeat its four lines rather than call it: the call would cost as much as their additions."""
        try:
            values: array[float] = self._local.values
        except AttributeError:
            values = self._adopt()
        return values

    def _make(self, label_values: Labels) -> int:
        if len(label_values) != len(self.labelnames):
            raise ValueError(f"{self.name}: label values {label_values!r} for label names {self.labelnames!r}")
        with self._lock:
            index = self._index.get(label_values)
            if index is not None:
                return index  # another thread made it meanwhile
            if len(self._labels) >= self.capacity:
                raise ValueError(f"{self.name}: no room for labels {label_values!r} (capacity {self.capacity})")
            self._labels.append(label_values)
            self._created.append(time.time())
            index = self._index[label_values] = len(self._labels) - 1
        return index

    def _new_array(self) -> array[float]:
        return array("d", bytes(8 * self.width * self.capacity))

    def _adopt(self) -> array[float]:
        values = self._new_array()
        with self._lock:
            self._threads[threading.current_thread()] = values
        self._local.values = values
        return values

    # -- scraping --------------------------------------------------------------------------------

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    def _family(self) -> Metric:
        """An empty family: prometheus_client's class for the type, which carries the label names
        (gemps_cli.reference_docs reads them for a family with no series yet)."""
        raise NotImplementedError

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            for thread in [thread for thread in self._threads if not thread.is_alive()]:
                ended = self._threads.pop(thread)  # its thread writes no more: fold it in
                for slot, value in enumerate(ended):
                    self._retired[slot] += value
            arrays = [self._retired, *self._threads.values()]
            children = list(zip(self._labels, self._created, strict=True))
        metric = self._family()
        created = prometheus_metrics._use_created
        for index, (label_values, made) in enumerate(children):
            base = index * self.width
            totals = [sum(values[slot] for values in arrays) for slot in range(base, base + self.width)]
            labels = dict(zip(self.labelnames, label_values, strict=True))
            self._add_samples(metric, labels, totals)
            if created:
                metric.add_sample(self.name + "_created", labels, made)
        return [metric]

    def _add_samples(self, metric: Metric, labels: dict[str, str], totals: list[float]) -> None:
        raise NotImplementedError


class CounterFamily(Family):
    def _family(self) -> Metric:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def inc(self, amount: float = 1.0, child: int = 0) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter only goes up, not by {amount}")
        try:
            values: array[float] = self._local.values
        except AttributeError:
            values = self._adopt()
        values[child] += amount

    def _add_samples(self, metric: Metric, labels: dict[str, str], totals: list[float]) -> None:
        metric.add_sample(self.name + "_total", labels, totals[0])


class SummaryFamily(Family):
    """Count and sum, no quantiles (as prometheus_client's Summary)."""

    width = 2

    def _family(self) -> Metric:
        return SummaryMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def observe(self, value: float, child: int = 0) -> None:
        try:
            values: array[float] = self._local.values
        except AttributeError:
            values = self._adopt()
        slot = 2 * child
        values[slot] += 1.0
        values[slot + 1] += value

    def _add_samples(self, metric: Metric, labels: dict[str, str], totals: list[float]) -> None:
        metric.add_sample(self.name + "_count", labels, totals[0])
        metric.add_sample(self.name + "_sum", labels, totals[1])


class HistogramFamily(Family):
    """Buckets at `bounds` (+Inf added when missing, as prometheus_client does)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        name: str,
        documentation: str,
        bounds: Sequence[float],
        labelnames: Sequence[str] = (),
        children: Iterable[Labels] = (),
        capacity: int = 0,
    ) -> None:
        upper = [float(bound) for bound in bounds]
        if upper != sorted(upper) or not upper:
            raise ValueError(f"{name}: bucket bounds {bounds!r} are not ascending")
        self.bounds = (*upper, INF) if upper[-1] != INF else tuple(upper)
        self.width = len(self.bounds) + 1
        self._sum = len(self.bounds)  # the sum's slot within a child's
        self._les: list[str] = [floatToGoString(bound) for bound in self.bounds]  # type: ignore[no-untyped-call]
        super().__init__(registry, name, documentation, labelnames, children, capacity)

    def _family(self) -> Metric:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def observe(self, value: float, child: int = 0) -> None:
        try:
            values: array[float] = self._local.values
        except AttributeError:
            values = self._adopt()
        base = child * self.width
        if value == value:  # not NaN: bisect would put a NaN in the first bucket, prometheus_client in none
            values[base + bisect_left(self.bounds, value)] += 1.0
        values[base + self._sum] += value

    def _add_samples(self, metric: Metric, labels: dict[str, str], totals: list[float]) -> None:
        count = 0.0
        for le, bucket in zip(self._les, totals, strict=False):
            count += bucket
            metric.add_sample(self.name + "_bucket", {**labels, "le": le}, count)
        metric.add_sample(self.name + "_count", labels, count)
        if self.bounds[0] >= 0:  # as prometheus_client: a sum of negative values would read as a reset
            metric.add_sample(self.name + "_sum", labels, totals[-1])


class GaugeFamily(Family):
    """A gauge set per event: one array for all threads, the last value set wins (no `_created`)."""

    def _family(self) -> Metric:
        return GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)

    # The one array all threads store into is the family's `_retired` (no thread owns it).

    def values(self) -> array[float]:
        return self._retired

    def set(self, value: float, child: int = 0) -> None:
        self._retired[child] = value

    def collect(self) -> Iterable[Metric]:
        metric = self._family()
        with self._lock:
            children = list(self._labels)
        for index, label_values in enumerate(children):
            metric.add_sample(self.name, dict(zip(self.labelnames, label_values, strict=True)), self._retired[index])
        return [metric]
