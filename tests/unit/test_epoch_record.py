"""The highest epoch a replica has seen, on its disk (epoch_record.py), and the rule that picks a
primary without an in-sync list (recovery.py): every replica reported, the newest state by
(epoch, version) wins, the next epoch above every one seen."""

from __future__ import annotations

from pathlib import Path

import pytest

from gemps_server.replication.epoch_record import FILE_NAME, EpochRecord, EpochRecordError
from gemps_server.replication.recovery import Report, judge

NAMES = ("r0", "r1", "r2")


def test_the_record_survives_the_process_and_only_rises(tmp_path: Path) -> None:
    record = EpochRecord(tmp_path)
    assert record.seen == 0 and not (tmp_path / FILE_NAME).exists()
    record.raise_to(7)
    record.raise_to(5)  # lower: nothing written
    assert record.seen == 7 and EpochRecord(tmp_path).seen == 7  # what a restarted process reads
    assert not [path for path in tmp_path.iterdir() if path.name != FILE_NAME]  # no temporary left
    memory = EpochRecord(None)
    memory.raise_to(3)
    assert memory.seen == 3 and memory.path is None


def test_an_unreadable_record_is_refused_not_read_as_zero(tmp_path: Path) -> None:
    (tmp_path / FILE_NAME).write_text("{not json")
    with pytest.raises(EpochRecordError, match=FILE_NAME):
        EpochRecord(tmp_path)


def test_a_record_that_cannot_be_written_is_not_raised(tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # the record's directory is a file: nothing can be written under it
    record = EpochRecord(blocked)
    with pytest.raises(EpochRecordError, match="cannot record epoch 4"):
        record.raise_to(4)
    assert record.seen == 0


def report(name: str, seen: int, held: tuple[int, int] | None) -> Report:
    return Report(name, f"{name}-incarnation", seen, held)


def test_a_dropped_backup_waits_for_the_primary_and_then_yields_to_it() -> None:
    """r1 was dropped at version 300 of epoch 9 while r0, the primary, acknowledged up to 500 and
    r2 was in sync (500): r1 may not campaign while r0 is missing, nor once it reported."""
    backups = {"r1": report("r1", 9, (9, 300)), "r2": report("r2", 9, (9, 500))}
    waiting = judge(NAMES, backups, seen=9, mine=(9, 300))
    assert waiting.missing == ("r0",) and not waiting.allows((9, 300)) and not waiting.allows((9, 500))
    every = {**backups, "r0": report("r0", 9, (9, 500))}
    verdict = judge(NAMES, every, seen=9, mine=(9, 300))
    assert not verdict.allows((9, 300)) and verdict.allows((9, 500)) and verdict.floor == 9


def test_a_replica_still_holding_a_lease_counts_as_missing() -> None:
    reports = {"r0": report("r0", 9, None), "r1": report("r1", 9, (9, 300)), "r2": report("r2", 9, (9, 300))}
    assert judge(NAMES, reports, seen=9, mine=(9, 300)).missing == ("r0",)


def test_the_epoch_comes_first_and_the_floor_is_every_epoch_seen() -> None:
    """A deposed primary of epoch 8 applied commits past version 500 that were never acknowledged;
    the primary of epoch 9 holds fewer commits, every acknowledged one among them. r2 saw epoch 11
    (a primary that never acted): the next epoch is counted above it."""
    reports = {"r0": report("r0", 8, (8, 900)), "r1": report("r1", 9, (9, 500)), "r2": report("r2", 11, (9, 480))}
    verdict = judge(NAMES, reports, seen=9, mine=(9, 500))
    assert verdict.allows((9, 500)) and not verdict.allows((8, 900)) and verdict.floor == 11


def test_reports_read_back_old_and_garbled_values() -> None:
    assert Report.from_json("r0", b'{"incarnation": "i", "epoch": 4, "version": 10}') == Report("r0", "i", 4, (4, 10))
    assert Report.from_json("r0", b'{"incarnation": "i", "seen": 6}') == Report("r0", "i", 6, None)
    assert Report.from_json("r0", b"bare-incarnation") == Report("r0", "bare-incarnation", 0, None)
    mine = Report("r1", "j", 5, (5, 3))
    assert Report.from_json("r1", mine.to_json().encode()) == mine
