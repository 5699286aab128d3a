"""The cross-host bench's plan and arithmetic (gemps_bench.cross_host), without hosts."""

from __future__ import annotations

import pytest
from gemps_bench.cross_host import CrossHostSpec, link_figures, path_fields
from gemps_bench.results import LoadResult
from gemps_bench.suite import CODES

from gemps_worker.simulated_hosts import rate_bits_per_second


@pytest.mark.parametrize(("rate", "bits"), [("1gbit", 1e9), ("100mbit", 1e8), ("2.5Gbit", 2.5e9), ("64kbit", 64e3)])
def test_rates_read_as_tc_reads_them(rate: str, bits: float) -> None:
    assert rate_bits_per_second(rate) == bits


@pytest.mark.parametrize("rate", ["1gbps", "fast", "0gbit", ""])
def test_a_rate_tc_would_not_take_is_refused(rate: str) -> None:
    with pytest.raises(ValueError, match="not a link rate"):
        rate_bits_per_second(rate)


def test_cells_put_the_ceiling_first_and_gemps_at_each_partition_count() -> None:
    spec = CrossHostSpec(partitions=(1, 2, 4))
    assert spec.cells() == [
        ("echo-tcp", 1),
        ("gemps", 1),
        ("gemps", 2),
        ("gemps", 4),
        ("gemps-bfloat16", 1),
        ("gemps-int8", 1),
        ("gemps-int4", 1),
        ("gemps-int8-both", 1),
        ("gemps-int4-both", 1),
        ("gemps-topk-int4", 1),
        ("torch-rpc-tcp", 1),
        ("reference-p2p", 1),
    ]
    assert spec.hosts_needed == 4
    assert CrossHostSpec(systems=("echo-tcp", "reference-p2p")).hosts_needed == 1


def test_systems_that_do_not_run_between_hosts_are_refused() -> None:
    with pytest.raises(ValueError, match="not run between hosts: torch-rpc"):
        CrossHostSpec(systems=("gemps", "torch-rpc"))


def test_the_links_share_is_payload_one_way_over_k_links() -> None:
    result = LoadResult("gemps", 1_000_000, 8, 10.0, [], [50] * 8)  # 40 commits/s of 4 MB each way
    figures = link_figures("gemps", 2, result, "1gbit")
    assert figures["payload_bytes_per_second_each_way"] == 160e6
    assert figures["link_fraction"] == pytest.approx(160e6 / 250e6)
    assert link_figures("gemps-bfloat16", 1, result, "1gbit")["link_fraction"] == pytest.approx(80e6 / 125e6)
    # int8 commits up (1,000,000 bytes and 3,907 scales of 4), float32 replies down: the busier way is down
    int8 = link_figures("gemps-int8", 1, result, "1gbit")
    assert (int8["commit_bytes_per_commit"], int8["reply_bytes_per_commit"]) == (1_015_628, 4_000_000)
    assert int8["link_fraction"] == pytest.approx(160e6 / 125e6)
    # and difference replies in the same codes: both ways a quarter of float32's
    both = link_figures("gemps-int8-both", 1, result, "1gbit")
    assert (both["commit_bytes_per_commit"], both["reply_bytes_per_commit"]) == (1_015_628, 1_015_628)
    assert both["link_fraction"] == pytest.approx(40 * 1_015_628 / 125e6)


def test_a_cells_record_says_what_gemps_plan_is_fitted_to_the_codes_included() -> None:
    """gemps_bench.capacity.path_of reads a cross-host cell's rule, wire, codes each way and
    transport; `codes` says which of the codec's passes ran (numpy's cost 3-7x the compiled CPU)."""
    both = path_fields("gemps-int8-both")
    assert both == {
        "rule": "gem", "wire_dtype": "float32", "compression": "int8", "reply_compression": "int8",
        "codes": CODES, "shared_memory": False,
    }  # fmt: skip
    assert CODES in ("compiled", "numpy") and path_fields("echo-tcp") == {}
