"""A rule of rounds' progress (adamw): the rounds it closed and the open one, read when scraped.

Under a rule of rounds the central version counts commits, and a round closes at K of them: the
rounds closed are the AdamW steps the model took, the figure a nanoGPT user's step count is. The
families are exported only while the rule has rounds (none under GEM); the gradients no round took
(a straggler's, after its round closed without it) are π = 0 in gemps_scaling_factor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gemps_proto.status import Rounds


class RoundsCollector(Collector):
    """Reads the rule's `Rounds` at each scrape (CommitRule.rounds)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._rounds: Callable[[], Rounds | None] = lambda: None  # none until observed
        registry.register(self)

    def observe(self, rounds: Callable[[], Rounds | None]) -> None:
        self._rounds = rounds

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())  # the names only: registering reads no rule

    def collect(self) -> Iterator[Metric]:
        rounds = self._rounds()
        if rounds is None:
            return iter(())
        closed, size, held = families = self._families()
        closed.add_metric([], rounds.closed)
        size.add_metric([], rounds.size)
        held.add_metric([], rounds.held)
        return iter(families)

    @staticmethod
    def _families() -> tuple[CounterMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        return (
            CounterMetricFamily(
                "gemps_rounds_closed",
                "Rounds the rule of rounds (adamw) closed: the AdamW steps taken on their means (outer steps on "
                "rounds of updates). A checkpoint carries the count.",
            ),
            GaugeMetricFamily(
                "gemps_round_size",
                "K: the commits the open round closes at (--round-size, else the workers registered less "
                "--backup-workers and never more than those still committing; after a restart from a checkpoint "
                "the K it kept, until as many workers registered again), as counted at the last commit, "
                "registration or departure.",
            ),
            GaugeMetricFamily("gemps_round_held", "Commits the open round holds."),
        )
