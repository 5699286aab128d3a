"""The SDK installed alone (`pip install gemps`: no numpy) against real servers, on every route:
a worker process in which numpy cannot be imported (tests/numpy_free_worker.py) registers,
commits by name, flat and with buffers, pulls, and is refused what needs numpy with an error that
names the option; θ and the buffers it ends with are bit for bit a numpy client's after the same
commits, with and without partitions. The install's size is measured in docs/guides/install.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import InProcessServer, scrape_series, start_partitions
from tests.integration.conftest import StartServer

pytestmark = pytest.mark.usefixtures("plane")  # shared memory, the data plane over TCP, gRPC

ROOT = Path(__file__).resolve().parents[2]
NUMPY_OPTIONS = ("compression", "bfloat16", "reply_compression")


def worker(target: str, *flags: str) -> dict[str, Any]:
    ran = subprocess.run(
        [sys.executable, "-m", "tests.numpy_free_worker", "--target", target, *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    found: dict[str, Any] = json.loads(ran.stdout)
    return found


def servers(start_server: StartServer, partitions: int) -> list[InProcessServer]:
    return start_partitions(start_server, partitions, rule="downpour", learning_rate=1.0, num_shards=0)


@pytest.mark.parametrize("partitions", [1, 2])
def test_a_worker_without_numpy_trains_as_a_numpy_worker_does(start_server: StartServer, partitions: int) -> None:
    alone = worker(servers(start_server, partitions)[0].target)
    reference = worker(servers(start_server, partitions)[0].target, "--with-numpy")
    assert alone["numpy"] is False and reference["numpy"] is True
    for received in ("committed", "pulled"):
        assert alone[received]["theta"] == reference[received]["theta"]  # float32 values, bit for bit
        assert alone[received]["buffers"] == reference[received]["buffers"]
        assert alone[received]["version"] == reference[received]["version"] == 3
        for name, (kind, shape, values) in alone[received]["named"].items():
            assert kind == "memoryview" and reference[received]["named"][name][0] == "ndarray"
            assert [shape, values] == reference[received]["named"][name][1:]
    assert alone["committed"]["buffers"] == {"count": [9], "mean": [0.5, 0.5]}  # 7 + 2; the mean's delta added
    assert alone["spec"] == [["w", [2, 3]], ["b", [2]]]
    assert alone["buffer_spec"] == [["count", [1], True], ["mean", [2], False]]  # an integer list: int64


def test_what_is_refused_without_numpy_says_what_to_install(start_server: StartServer) -> None:
    alone = worker(servers(start_server, 1)[0].target)
    refused = alone["refused"]
    assert refused["nan"][0] == "InvalidArgumentError" and "NaN or Inf" in refused["nan"][1]
    assert refused["misspelled"][0] == "NamedPayloadError" and "bias" in refused["misspelled"][1]
    assert refused["text"][0] == "InvalidArgumentError" and "'b' is not an array of numbers" in refused["text"][1]
    for option in NUMPY_OPTIONS:
        kind, message = refused[option]
        assert kind == "NumpyRequiredError", (option, kind, message)
        assert option.replace("bfloat16", "wire_dtype") in message and "pip install 'gemps[numpy]'" in message
    reference = worker(servers(start_server, 1)[0].target, "--with-numpy")
    assert all(reference["refused"][option] == ["", "nothing raised"] for option in NUMPY_OPTIONS)
    # A counter past int64 (issue 77, item 7): a bare OverflowError here, registered silently as a
    # float buffer with numpy; now the same refusal in both worlds, naming the buffer, before sending.
    past_int64 = [
        "Int64RangeError",
        "buffer 'count': 18446744073709551616 is outside int64's range [-2**63, 2**63 - 1]",
    ]
    for refusal in ("count_past_int64", "delta_past_int64"):
        assert alone["refused"][refusal] == reference["refused"][refusal] == past_int64, refusal


def test_a_model_past_a_megabyte_streams_without_numpy(start_server: StartServer, plane: str) -> None:
    """300,000 values (1.2 MB): RegisterStream and CommitStream on the gRPC plane."""
    server = servers(start_server, 1)[0]
    alone = worker(server.target, "--large", "300000")
    if plane == "grpc":
        series = scrape_series(f"http://127.0.0.1:{server.metrics_port}/metrics")
        for method, calls in (("RegisterStream", 1), ("CommitStream", 2)):
            counted = [value for name, value in series.items() if f'method="{method}"' in name and "_count{" in name]
            assert sum(counted) == calls, (method, counted)
    reference = worker(servers(start_server, 1)[0].target, "--large", "300000", "--with-numpy")
    assert alone["pulled_equal"] and reference["pulled_equal"]
    assert alone["committed"] == reference["committed"] and len(alone["committed"]) == 301


def test_the_asyncio_client_without_numpy(start_server: StartServer) -> None:
    alone = worker(servers(start_server, 1)[0].target, "--aio")
    reference = worker(servers(start_server, 1)[0].target, "--aio", "--with-numpy")
    assert alone["versions"] == reference["versions"] == [1, 2, 3]
    assert alone["pulled"]["theta"] == reference["pulled"]["theta"]
