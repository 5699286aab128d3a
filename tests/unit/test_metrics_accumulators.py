"""The per-event accumulators (metrics/accumulators.py): exact counts from several recording threads
while the page is scraped, threads that end folded in, the arrays' layout as a compiled recorder
sees it, and bad input refused by name."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gemps_proto.reasons import Reason
from gemps_proto.tensor_codec import FLOAT32
from gemps_server.domain.rules import ApplyStats
from gemps_server.metrics import ServerMetrics
from gemps_server.metrics.accumulators import CounterFamily, GaugeFamily, HistogramFamily, SummaryFamily

THREADS = 4
BATCH = 100  # commits a recording thread makes between looks at whether to stop
SCRAPES = 5  # at least, while the threads record
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(registry: CollectorRegistry) -> Samples:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def commits(metrics: ServerMetrics, plane: str) -> None:
    """BATCH commits' worth of events, every value a binary fraction: their sums are exact."""
    stats = ApplyStats(0.5, 0.5, 0.25, 0.0, proxy_energy=0.5, central_energy=0.25)
    for event in range(BATCH):
        metrics.tensor_bytes("received", FLOAT32, 4)
        metrics.applied(event % 20, stats, loss=1.0, num_samples=2, queued_seconds=2**-10, apply_seconds=2**-12)
        metrics.applier_ran(2**-11, 2**-12)
        metrics.rejected(Reason.NON_FINITE)
        metrics.rpc("Commit", 2**-11, plane)
        metrics.message_received("Commit", 3, plane)
        metrics.message_sent("Commit", 5, plane)


def run_threads(target: Callable[[int], None], count: int = THREADS) -> None:
    threads = [threading.Thread(target=target, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_counts_from_several_threads_are_exact_while_scraped() -> None:
    metrics = ServerMetrics()
    start = threading.Barrier(THREADS + 1)
    scraped = threading.Event()
    scrapes: list[Samples] = []
    batches = [0] * THREADS

    def scrape() -> None:
        start.wait()
        while len(scrapes) < SCRAPES:
            scrapes.append(samples(metrics.registry))
        scraped.set()

    scraper = threading.Thread(target=scrape)
    scraper.start()

    def record(index: int) -> None:
        start.wait()
        while not scraped.is_set() or batches[index] < 10:
            commits(metrics, ("grpc", "data")[index % 2])
            batches[index] += 1

    run_threads(record)
    scraper.join()
    got = samples(metrics.registry)
    total = BATCH * sum(batches)
    assert got[("gemps_commits_total", (("outcome", "applied"), ("reason", "")))] == total
    assert got[("gemps_commits_total", (("outcome", "rejected"), ("reason", "non_finite")))] == total
    assert got[("gemps_commit_staleness_count", ())] == total
    assert got[("gemps_commit_staleness_sum", ())] == sum(batches) * sum(event % 20 for event in range(BATCH))
    assert got[("gemps_commit_staleness_bucket", (("le", "0.0"),))] == total / 20
    assert got[("gemps_training_samples_total", ())] == 2 * total
    assert got[("gemps_training_loss_sum", ())] == total
    assert got[("gemps_commit_duration_seconds_sum", (("phase", "queue_wait"),))] == total * 2**-10
    assert got[("gemps_applier_busy_seconds_total", ())] == total * 2**-11
    assert got[("gemps_commit_clamped_ratio_sum", (("bound", "zero"),))] == total / 4
    assert got[("gemps_gem_energy_count", (("side", "central"),))] == total
    assert got[("gemps_wire_bytes_total", (("direction", "received"), ("encoding", "float32")))] == 4 * total
    for plane, recorded in (("grpc", batches[0::2]), ("data", batches[1::2])):
        labels = (("method", "Commit"), ("plane", plane))
        assert got[("gemps_rpc_duration_seconds_count", labels)] == BATCH * sum(recorded)
        assert got[("gemps_received_bytes_total", labels)] == 3 * BATCH * sum(recorded)
        assert got[("gemps_sent_bytes_total", labels)] == 5 * BATCH * sum(recorded)
    # Scraped while they recorded: each scrape consistent (a histogram's count is its +Inf
    # bucket's), none ahead of the next.
    applied = ("gemps_commits_total", (("outcome", "applied"), ("reason", "")))
    for before, after in zip(scrapes, [*scrapes[1:], got], strict=True):
        assert before[applied] <= after[applied]
        count = before[("gemps_commit_staleness_count", ())]
        assert count == before[("gemps_commit_staleness_bucket", (("le", "+Inf"),))]


def test_threads_that_ended_are_folded_in_and_leave_no_arrays() -> None:
    metrics = ServerMetrics()
    family = metrics.commits.commits
    for _ in range(3):  # three generations of short-lived threads, scraped between them
        run_threads(lambda _: metrics.rejected(Reason.SUPERSEDED), count=10)
        samples(metrics.registry)
        assert len(family._threads) == 0  # every recording thread has ended: all folded
    metrics.rejected(Reason.SUPERSEDED)  # and this thread's own, alive
    got = samples(metrics.registry)
    assert got[("gemps_commits_total", (("outcome", "rejected"), ("reason", "superseded")))] == 31
    assert len(family._threads) == 1


def test_a_child_made_by_several_threads_at_once_is_made_once() -> None:
    metrics = ServerMetrics()
    start = threading.Barrier(THREADS)

    def record(_: int) -> None:
        start.wait()
        for _ in range(100):
            metrics.tensor_bytes("sent", 99, 2)  # no such dtype: "other", made at the first

    run_threads(record)
    text = generate_latest(metrics.registry).decode()
    assert text.count('gemps_wire_bytes_total{direction="sent",encoding="other"} 800.0') == 1
    assert 'direction="received",encoding="other"' not in text  # made only where recorded


def test_a_compiled_recorder_adds_into_the_threads_array_through_the_buffer_protocol() -> None:
    registry = CollectorRegistry()
    histogram = HistogramFamily(registry, "h", "A histogram.", (1.0, 2.0), ["side"], [("a",), ("b",)])
    counter = CounterFamily(registry, "c", "A counter.", ["side"], [("a",), ("b",)])
    summary = SummaryFamily(registry, "s", "A summary.")
    gauge = GaugeFamily(registry, "g", "A gauge.")
    # What a C function would do with each family's Py_buffer: add at the documented slots.
    child = histogram.child("b")
    slots = np.frombuffer(histogram.values(), dtype=np.float64)  # no copy: the thread's array itself
    assert histogram.width == 4 and slots.size == 2 * histogram.width  # buckets le=1, 2, +Inf, then the sum
    slots[child * histogram.width + 1] += 3  # three values in (1, 2]
    slots[child * histogram.width + 3] += 4.5
    np.frombuffer(counter.values(), dtype=np.float64)[counter.child("b")] += 7
    np.frombuffer(summary.values(), dtype=np.float64)[:] += (2, 0.5)  # count, sum
    np.frombuffer(gauge.values(), dtype=np.float64)[0] = -1.5
    histogram.observe(0.5, child)  # and Python, into the same array
    got = samples(registry)
    assert got[("h_bucket", (("le", "1.0"), ("side", "b")))] == 1
    assert got[("h_bucket", (("le", "2.0"), ("side", "b")))] == 4
    assert got[("h_count", (("side", "b"),))] == 4
    assert got[("h_sum", (("side", "b"),))] == 5.0
    assert got[("h_count", (("side", "a"),))] == 0
    assert got[("c_total", (("side", "b"),))] == 7
    assert (got[("s_count", ())], got[("s_sum", ())], got[("g", ())]) == (2, 0.5, -1.5)


def test_bad_input_is_refused_by_name() -> None:
    registry = CollectorRegistry()
    counter = CounterFamily(registry, "gemps_c", "A counter.", ["side"], [("a",)])
    with pytest.raises(ValueError, match="gemps_c: a counter only goes up, not by -1"):
        counter.inc(-1)
    with pytest.raises(ValueError, match=r"gemps_c: label values \('a', 'b'\)"):
        counter.child("a", "b")
    with pytest.raises(ValueError, match=r"gemps_c: no room for labels \('b',\) \(capacity 1\)"):
        counter.child("b")
    with pytest.raises(ValueError, match="gemps_h: bucket bounds"):
        HistogramFamily(registry, "gemps_h", "A histogram.", (2.0, 1.0))
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        CounterFamily(registry, "gemps_c", "The same name again.")
    with pytest.raises(ValueError, match="direction 'up'"):
        ServerMetrics().tensor_bytes("up", FLOAT32, 4)


def test_created_series_go_when_prometheus_client_disables_them() -> None:
    metrics = ServerMetrics()
    metrics.applied(1, ApplyStats.constant(1.0), None, None, 0.0, 0.0)
    prometheus_client.disable_created_metrics()
    try:
        text = generate_latest(metrics.registry).decode()
    finally:
        prometheus_client.enable_created_metrics()
    assert "_created" not in text
    assert "gemps_commit_staleness_created" in generate_latest(metrics.registry).decode()


@pytest.mark.parametrize("plane", ["grpc", "data"])
def test_one_call_records_what_its_three_events_record(plane: str) -> None:
    """TrafficMetrics.call (the data plane's one call a request) is rpc(), message_received() and
    message_sent() to the sample."""
    apart, together = ServerMetrics(), ServerMetrics()
    for seconds, received, sent in ((2**-11, 3, 5), (0.25, 400_000, 17), (30.0, 0, 0)):
        apart.rpc("Commit", seconds, plane)
        apart.message_received("Commit", received, plane)
        apart.message_sent("Commit", sent, plane)
        together.traffic.call("Commit", seconds, received, sent, plane)

    def served(metrics: ServerMetrics) -> Samples:  # the server's own series (not the process's, nor times)
        found = samples(metrics.registry).items()
        return {key: value for key, value in found if key[0].startswith("gemps_") and not key[0].endswith("_created")}

    recorded = served(together)
    assert recorded == served(apart)
    assert recorded[("gemps_rpc_duration_seconds_count", (("method", "Commit"), ("plane", plane)))] == 3
