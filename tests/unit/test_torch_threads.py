"""How many intra-op threads torch gets when workers share a machine (gemps.pytorch.threads)."""

from __future__ import annotations

import pytest

from gemps.pytorch.threads import AUTO, Decision, decide, requested


def auto(
    current: int, *, found: int = 8, ours: int | None = None, explicit: bool = False, cores: int = 8, workers: int = 1
) -> Decision:
    return decide(AUTO, current=current, found=found, ours=ours, explicit=explicit, cores=cores, workers=workers)


def test_auto_shares_the_cores_among_the_workers_of_the_machine() -> None:
    assert auto(8, workers=1) == Decision()  # alone: torch's own choice stands
    assert auto(8, workers=4) == Decision(threads=2)
    assert auto(8, cores=2, workers=4) == Decision(threads=1)  # the 4 workers on 2 cores
    assert auto(8, cores=3, workers=2) == Decision(threads=1)


def test_auto_only_lowers_and_follows_workers_that_come_and_go() -> None:
    assert auto(4, found=4, cores=16, workers=2) == Decision()  # 8 each would be more than torch chose
    assert auto(2, ours=2, workers=2) == Decision(threads=4)  # a worker left: back up to its share
    assert auto(4, ours=4, workers=1) == Decision(threads=8)  # ... at most what torch chose


def test_threads_set_otherwise_are_left_and_warned_about_when_they_oversubscribe() -> None:
    changed = auto(6, cores=2, workers=4)  # set after import: not torch's own
    assert changed.threads is None and "torch.set_num_threads(1)" in changed.warning and "threads=" in changed.warning
    assert auto(8, explicit=True, cores=2, workers=4).threads is None  # OMP_NUM_THREADS
    assert auto(3, ours=1, cores=2, workers=4).warning  # moved after gemps set it
    assert auto(1, cores=2, workers=4) == Decision()  # set lower: nothing to say


def test_a_number_is_set_as_given_and_none_leaves_them() -> None:
    assert decide(3, current=8, found=8, ours=None, explicit=True, cores=2, workers=4) == Decision(threads=3)
    assert decide(None, current=8, found=8, ours=None, explicit=False, cores=2, workers=4) == Decision()


def test_the_environment_stands_for_auto_and_bad_values_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEMPS_THREADS", "2")
    assert requested(AUTO) == 2 and requested(5) == 5 and requested(None) is None
    monkeypatch.setenv("GEMPS_THREADS", "many")
    with pytest.raises(ValueError, match="GEMPS_THREADS='many'"):
        requested(AUTO)
    monkeypatch.delenv("GEMPS_THREADS")
    assert requested(AUTO) == AUTO
    for bad in (0, -1, True, 1.5, "4"):
        with pytest.raises(ValueError, match="threads="):
            requested(bad)  # type: ignore[arg-type]
