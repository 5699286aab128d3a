"""Memory claims of separate jobs on one host (issue 61, item 9): a server settling its budget
subtracts what the other live gemps servers claimed and have not taken yet, then claims what it
could admit; a dead claimant's claim, or a reused pid's, is ignored and removed; a folder that
cannot be used is said, and the budget settled as before. Each "process" here is a folder laid out
as /proc/<pid> (its start time and resident memory), so that two servers live in one test."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from gemps_server.memory_budget import GIB, MIB, RESERVED_BYTES, RESERVED_VECTORS, Headroom, MemoryBudget
from gemps_server.memory_claims import MemoryClaims, Processes, default_folder, folder_of
from tests.helpers import server_config

HOST = Headroom(12 * GIB, "the host's available memory")
THETA = 4 * MIB  # θ of 1M float32 values
PER_WORKER = 8 * MIB  # GEM's m_i and s_i
HELD = PER_WORKER + THETA // 2  # and a difference reply's bfloat16 copy: what a worker may hold
RESERVE = RESERVED_VECTORS * THETA + RESERVED_BYTES


def process(proc: Path, pid: int, started: int = 1000, resident: int = 100 * MIB, shared: int = 0) -> None:
    """Process `pid` as /proc shows it (its name holds a space and a parenthesis, as names may):
    `resident` bytes of its own (RssAnon), `shared` of its clients' shared memory mapped (RssShmem)."""
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    (proc / str(pid) / "stat").write_text(f"{pid} (gemps) server) S 1 {pid} {pid} 0 -1 " + "0 " * 13 + f"{started} 0\n")
    kib = {"VmRSS": (resident + shared) // 1024, "RssAnon": resident // 1024, "RssShmem": shared // 1024}
    (proc / str(pid) / "status").write_text("Name:\tgemps\n" + "".join(f"{k}:\t{v} kB\n" for k, v in kib.items()))


def server(folder: Path, proc: Path, pid: int, probe: Headroom = HOST, **options: int) -> MemoryBudget:
    process(proc, pid)
    claims = MemoryClaims(folder, group=options.pop("group", 0), pid=pid, processes=Processes(proc))
    return MemoryBudget(options.pop("configured_mb", 0), probe=lambda: probe, claims=claims, **options)


def test_processes_reads_start_time_and_resident_memory(tmp_path: Path) -> None:
    process(tmp_path, 7, started=4242, resident=300 * MIB, shared=200 * MIB)
    assert Processes(tmp_path).started(7) == 4242 and Processes(tmp_path).resident(7) == 300 * MIB  # not RssShmem
    (tmp_path / "7" / "status").write_text("Name:\tgemps\nVmRSS:\t1024 kB\n")  # a kernel before 4.5
    assert Processes(tmp_path).resident(7) == MIB
    assert Processes(tmp_path).started(8) is None and Processes(tmp_path).resident(8) is None
    mine = Processes().started(os.getpid())
    assert mine is not None and mine > 0


def test_a_second_job_admits_what_the_first_left_not_the_whole_host(tmp_path: Path) -> None:
    """The issue's case: each job admitted all of the host (the first's state being allocated
    lazily, the second's probe saw it as free). Together they now admit what one alone would."""
    folder, proc = tmp_path / "claims", tmp_path / "proc"
    alone = MemoryBudget(probe=lambda: HOST)
    alone.settle(THETA, PER_WORKER, max_workers=4096)
    first, second = server(folder, proc, 101), server(folder, proc, 102)
    first.settle(THETA, PER_WORKER, max_workers=600)  # could hold 600 workers: 5.9 GiB, and its reserve
    assert first.bytes == alone.bytes == 12 * GIB - RESERVE
    assert first.claims is not None
    claimed = 600 * HELD + RESERVE
    assert json.loads(first.claims.path.read_text())["bytes"] == claimed
    second.settle(THETA, PER_WORKER, max_workers=300)
    assert second.bytes == 12 * GIB - claimed - RESERVE
    assert 600 * HELD + second.bytes <= alone.bytes  # together within what one alone admits
    assert "less 6.1 GiB claimed by 1 other gemps server (pid 101)" in second.describe()

    # The first takes 2 GiB of its claim: the host has 2 GiB less, and the claim holds back 2 GiB less.
    process(proc, 101, resident=100 * MIB + 2 * GIB)
    third = server(folder, proc, 103, probe=Headroom(HOST.bytes - 2 * GIB, HOST.source))
    third.settle(THETA, PER_WORKER, max_workers=1)
    assert third.bytes == 10 * GIB - (claimed - 2 * GIB) - (300 * HELD + RESERVE) - RESERVE
    assert "claimed by 2 other gemps servers (pids 101, 102)" in third.describe()

    # Its local workers' θ regions (RssShmem) are their memory, not taken of its claim (issue 77,
    # item 7): the first still holds back its claim less 2 GiB, as the third found.
    process(proc, 101, resident=100 * MIB + 2 * GIB, shared=1 * GIB)
    fourth = server(folder, proc, 104, probe=Headroom(HOST.bytes - 2 * GIB, HOST.source))
    fourth.settle(THETA, PER_WORKER, max_workers=1)
    assert third.bytes is not None and fourth.bytes == third.bytes - (HELD + RESERVE)  # and the third's claim


def test_a_dead_claimant_or_a_reused_pid_holds_nothing_back(tmp_path: Path) -> None:
    folder, proc = tmp_path / "claims", tmp_path / "proc"
    dead, reused = server(folder, proc, 201), server(folder, proc, 202)
    for budget in (dead, reused):
        budget.settle(THETA, PER_WORKER, max_workers=100)
    assert len(list(folder.glob("*.claim"))) == 2
    (proc / "201" / "stat").unlink()  # gone
    process(proc, 202, started=9999)  # another process has its pid now
    later = server(folder, proc, 203)
    later.settle(THETA, PER_WORKER, max_workers=100)
    assert later.bytes == 12 * GIB - RESERVE and "claimed" not in later.describe()
    assert [path.name for path in folder.glob("*.claim")] == [later.claims.path.name if later.claims else ""]
    assert later.claims is not None
    later.claims.withdraw()
    assert list(folder.glob("*.claim")) == []


def test_a_configured_budget_is_not_reduced_but_claimed_within_the_host(tmp_path: Path) -> None:
    folder, proc = tmp_path / "claims", tmp_path / "proc"
    other = server(folder, proc, 301)
    other.settle(THETA, PER_WORKER, max_workers=100)
    configured = server(folder, proc, 302, configured_mb=1 << 20)  # 1 TiB, more than the host
    configured.settle(THETA, PER_WORKER, max_workers=1 << 20)
    assert configured.bytes == 1 << 40 and configured.describe() == "1024.0 GiB (--memory-budget-mb)"
    assert configured.claims is not None
    assert json.loads(configured.claims.path.read_text())["bytes"] == HOST.bytes  # what the host has, no more
    assert json.loads(configured.claims.path.read_text())["group"] == 0
    late = server(folder, proc, 303)
    late.settle(THETA, PER_WORKER, max_workers=1)
    assert late.bytes == 0 and late.workers(PER_WORKER) == 0


def test_one_supervisors_processes_share_by_their_share_not_by_claims(tmp_path: Path) -> None:
    """--memory-share already divides the host between a supervisor's children: their claims are
    not subtracted again from each other, only from other jobs (and theirs from them)."""
    folder, proc = tmp_path / "claims", tmp_path / "proc"
    children = [server(folder, proc, 400 + i, group=399, share=3) for i in range(3)]
    for child in children:
        child.settle(THETA, PER_WORKER, max_workers=4096)
    assert {child.bytes for child in children} == {12 * GIB // 3 - RESERVE}
    other_job = server(folder, proc, 500)
    other_job.settle(THETA, PER_WORKER, max_workers=1)
    assert other_job.bytes == 0 and "claimed by 3 other gemps servers (pids 400, 401, 402)" in other_job.describe()


def test_an_unusable_folder_is_said_and_the_budget_settled_as_before(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    budget = server(blocker / "claims", tmp_path / "proc", 601)  # a folder under a file: cannot be made
    with caplog.at_level(logging.WARNING, logger="gemps.server"):
        budget.settle(THETA, PER_WORKER, max_workers=4)
    assert budget.bytes == 12 * GIB - RESERVE
    warnings = [record.getMessage() for record in caplog.records if "memory claims unusable" in record.getMessage()]
    assert len(warnings) == 1 and str(blocker / "claims") in warnings[0] and "--memory-claims-dir" in warnings[0]


def test_an_unreadable_claim_is_said_and_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder, proc = tmp_path / "claims", tmp_path / "proc"
    folder.mkdir()
    (folder / "77.0.claim").write_text("not json")
    budget = server(folder, proc, 701)
    with caplog.at_level(logging.WARNING, logger="gemps.server"):
        budget.settle(THETA, PER_WORKER, max_workers=4)
    assert budget.bytes == 12 * GIB - RESERVE
    assert any("memory claim unreadable" in r.getMessage() and "77.0.claim" in r.getMessage() for r in caplog.records)


def test_the_option_names_a_folder_auto_or_off() -> None:
    assert folder_of("auto") == default_folder() and folder_of("off") is None
    assert str(default_folder()).startswith("/dev/shm/gemps-memory-claims-")
    assert server_config(memory_claims_dir="/run/gemps").memory_claims_dir == "/run/gemps"
    with pytest.raises(ValueError, match="memory_claims_dir 'claims' is not an absolute path"):
        server_config(memory_claims_dir="claims")


def test_claims_are_not_taken_from_an_address_space_limit_of_its_own(tmp_path: Path) -> None:
    """RLIMIT_AS bounds this process alone: another job's claim is of the host's memory, so it
    lowers the budget only where the host then has less than the limit leaves."""
    folder, proc = tmp_path / "claims", tmp_path / "proc"
    server(folder, proc, 801).settle(THETA, PER_WORKER, max_workers=1)  # claims 10 MiB and its reserve
    limited = server(folder, proc, 802, probe=Headroom(GIB, "its address-space limit", per_process=True))
    limited.settle(THETA, PER_WORKER, max_workers=1)
    assert limited.bytes == GIB - RESERVE and "claimed" not in limited.describe()
