"""The metrics page, byte for byte: a fixed sequence of events (commits with and without GEM's
stats, rejections, RPCs on both planes, tensor bytes, the rarer events) rendered as Prometheus text
and as OpenMetrics, against golden pages prometheus_client's own Counter/Histogram/Summary/Gauge
rendered before the per-event accumulators (metrics/accumulators.py) replaced them on the hot
path. What may differ between runs is masked: `_created` values (when a series was made), the
process's own figures (process_*), and the build's versions."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, enable_created_metrics, generate_latest
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from gemps_proto.reasons import Reason
from gemps_proto.tensor_codec import FLOAT32, INT8_BLOCK
from gemps_server.domain.rules import ApplyStats
from gemps_server.metrics import ServerMetrics

GOLDEN = Path(__file__).parent / "golden"


@pytest.fixture(autouse=True)
def created_series() -> Iterator[None]:
    """The golden pages have `_created` series. Whether prometheus_client renders them is one
    switch for the whole process, and an in-process server turns it off (as `gemps server` does):
    a runner that had started one before rendered these pages without them. On here, restored after."""
    before = prometheus_metrics._use_created
    enable_created_metrics()
    yield
    prometheus_metrics._use_created = before


UNKNOWN_DTYPE = 99  # no encoding of that number: counted under encoding="other"


def events(metrics: ServerMetrics) -> None:
    """Every event method once or more, values on bucket bounds, above the last, NaN and 0."""
    gem = ApplyStats.of(np.array([0.0, 0.0, 1.0, 5.0], np.float32), 5.0, proxy_energy=0.2, central_energy=0.3)
    metrics.applied(7, gem, loss=0.25, num_samples=64, queued_seconds=0.001, apply_seconds=0.002)
    metrics.applied(0, ApplyStats.constant(1.0), loss=math.nan, num_samples=None, queued_seconds=0.0, apply_seconds=0)
    metrics.applied(2000, gem, loss=1.5, num_samples=0, queued_seconds=12.0, apply_seconds=1e-5)
    nan_scaling = ApplyStats(math.nan, 0.5, 1.0, 0.0, proxy_energy=math.inf, central_energy=0.1)
    metrics.applied(4, nan_scaling, loss=-math.inf, num_samples=3, queued_seconds=2.5e-4, apply_seconds=7e-4)
    metrics.rejected(Reason.NON_FINITE)
    metrics.rejected(Reason.NON_FINITE)
    metrics.rejected(Reason.SUPERSEDED)
    metrics.applier_ran(0.003, 0.002)
    metrics.applier_ran(0.5)
    metrics.rpc("Commit", 0.004)
    metrics.rpc("Pull", 0.0002, plane="data")
    metrics.rpc("Commit", 30.0, plane="data")
    metrics.rpc("Register", 1.0)
    metrics.message_received("Commit", 1024)
    metrics.message_received("Commit", 4000, plane="data")
    metrics.message_sent("Pull", 4096, plane="data")
    metrics.message_sent("Register", 17)
    metrics.tensor_bytes("received", INT8_BLOCK, 1040)
    metrics.tensor_bytes("sent", FLOAT32, 4096)
    metrics.tensor_bytes("sent", FLOAT32, 4096)
    metrics.tensor_bytes("received", UNKNOWN_DTYPE, 10)
    metrics.data_plane_refused("bad_hello")
    metrics.registered()
    metrics.registered()
    metrics.shared_shard()
    metrics.departed("left")
    metrics.departed("evicted", 0)
    metrics.departed("evicted", 2)
    metrics.duplicate()
    metrics.checkpointed(12, 4096, 0.05)
    metrics.checkpoint_failed()
    metrics.refusal(Reason.BUSY)
    metrics.evaluated("mnist", 10, 0.3, 0.9)
    metrics.data_plane_connections.inc()
    metrics.checkpoint_version.set(12)


def masked(page: str) -> str:
    """The page less what varies between runs (see the module's docstring)."""
    lines = [line for line in page.splitlines() if not re.match(r"(# (HELP|TYPE|UNIT) )?process_", line)]
    lines = [re.sub(r"^(\w+_created(\{.*\})?) \S+$", r"\1 <created>", line) for line in lines]
    lines = [re.sub(r"^gemps_build_info\{.*\} ", "gemps_build_info{<versions>} ", line) for line in lines]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "render,golden", [(generate_latest, "server_metrics.prom"), (generate_openmetrics, "server_metrics.openmetrics")]
)
def test_the_page_after_a_fixed_sequence_of_events_is_the_golden_one(
    render: Callable[[CollectorRegistry], bytes], golden: str
) -> None:
    metrics = ServerMetrics()
    events(metrics)
    page = masked(render(metrics.registry).decode())
    assert page == (GOLDEN / golden).read_text()


def test_a_fresh_page_is_the_golden_one() -> None:
    page = masked(generate_latest(ServerMetrics().registry).decode())
    assert page == (GOLDEN / "server_metrics_fresh.prom").read_text()
