"""The SDK's primary watch (gemps.primary_watch) on its own: which answers of a partition's replicas
wake a call that waits on its primary. Real threads, replicas' answers scripted."""

from __future__ import annotations

import threading

from gemps.primary_watch import PrimaryWatch
from gemps.resolver import Replicas
from gemps_proto.schema import TrainingConfig
from gemps_proto.status import BACKUP, CANDIDATE, PRIMARY, ReplicationStatus, ServerStatus

WAITED_ON, OTHER = "10.0.0.1:50051", "10.0.0.2:50051"
PATIENCE = 30.0  # seconds an event may take under a loaded machine: never reached when it works


class BlockedCall:
    """The transport a call is blocked in: interrupt() is what the watch does to wake it."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.woken = threading.Event()

    def interrupt(self) -> None:
        self.woken.set()


OURS = "our-job"


class Answers:
    """Each replica's role and epoch as Status says it, and its job (ours unless `jobs` says);
    counts the questions put to each."""

    def __init__(self, roles: dict[str, tuple[str, int]], jobs: dict[str, str] | None = None) -> None:
        self.roles = roles
        self.jobs = jobs or {}
        self.asked = {address: 0 for address in roles}
        self.asked_enough = threading.Event()

    def __call__(self, address: str) -> ServerStatus:
        self.asked[address] += 1
        if min(self.asked.values()) >= 5:
            self.asked_enough.set()
        role, epoch = self.roles[address]
        replication = ReplicationStatus(address, role, epoch=epoch, replicas=2)
        job = self.jobs.get(address, OURS)
        return ServerStatus(True, 1, 1, 4, TrainingConfig(), 1, 0, (), 1.0, None, replication=replication, job=job)


def watched_call(answers: Answers, acknowledged_epoch: int) -> tuple[BlockedCall, str]:
    """A call to WAITED_ON under watch until it is woken or every replica was asked 5 times: the
    call, and the replica the watch moved it to ("" when it was not woken)."""
    watch = PrimaryWatch(lambda: replicas, answers, lambda: OURS, after=0.01, every=0.01)
    replicas = Replicas([WAITED_ON, OTHER])
    watch.epoch = acknowledged_epoch
    call = BlockedCall(WAITED_ON)
    with watch.watching(call) as watched:
        woken = threading.Thread(target=call.woken.wait, args=(PATIENCE,))
        enough = threading.Thread(target=answers.asked_enough.wait, args=(PATIENCE,))
        woken.start()
        enough.start()
        while woken.is_alive() and enough.is_alive():
            woken.join(0.01)
        took_over = watched.took_over
    watch.close()
    return call, took_over


def test_a_call_moves_to_another_replica_that_says_it_is_primary() -> None:
    call, took_over = watched_call(Answers({WAITED_ON: (PRIMARY, 3), OTHER: (PRIMARY, 4)}), acknowledged_epoch=3)
    assert call.woken.is_set() and took_over == OTHER


def test_a_primary_that_lost_its_lease_and_won_it_again_is_called_again() -> None:
    """Its cable pulled for a few seconds: the call was made under epoch 3, the replica is primary
    again under 11, and the old attempt's connection may stay silent long after the heal."""
    call, took_over = watched_call(Answers({WAITED_ON: (PRIMARY, 11), OTHER: (BACKUP, 11)}), acknowledged_epoch=3)
    assert call.woken.is_set() and took_over == WAITED_ON


def test_a_primary_still_under_the_acknowledging_epoch_is_waited_for() -> None:
    """A commit waits on a slow backup within --replica-timeout: nothing to move away from."""
    answers = Answers({WAITED_ON: (PRIMARY, 3), OTHER: (BACKUP, 3)})
    call, took_over = watched_call(answers, acknowledged_epoch=3)
    assert answers.asked_enough.is_set() and not call.woken.is_set() and took_over == ""


def test_no_replica_primary_yet_leaves_the_call_waiting() -> None:
    answers = Answers({WAITED_ON: (CANDIDATE, 3), OTHER: (CANDIDATE, 3)})
    call, took_over = watched_call(answers, acknowledged_epoch=3)
    assert answers.asked_enough.is_set() and not call.woken.is_set() and took_over == ""


def test_another_jobs_primary_is_not_followed() -> None:
    """An address of the list that is now another job's primary (issue 77, item 1)."""
    answers = Answers({WAITED_ON: (PRIMARY, 3), OTHER: (PRIMARY, 9)}, jobs={OTHER: "their-job"})
    call, took_over = watched_call(answers, acknowledged_epoch=3)
    assert answers.asked_enough.is_set() and not call.woken.is_set() and took_over == ""


def test_a_primary_under_an_older_epoch_than_acknowledged_is_not_followed() -> None:
    """A resumed ex-primary that has not yet noticed its lease is gone (issue 77, item 9)."""
    answers = Answers({WAITED_ON: (PRIMARY, 5), OTHER: (PRIMARY, 4)})
    call, took_over = watched_call(answers, acknowledged_epoch=5)
    assert answers.asked_enough.is_set() and not call.woken.is_set() and took_over == ""


def test_a_server_of_another_job_waited_on_is_not_called_again_under_its_newer_epoch() -> None:
    """The address waited on now answers for another job, under a newer epoch of that job's."""
    answers = Answers({WAITED_ON: (PRIMARY, 8), OTHER: (BACKUP, 3)}, jobs={WAITED_ON: "their-job"})
    call, took_over = watched_call(answers, acknowledged_epoch=3)
    assert answers.asked_enough.is_set() and not call.woken.is_set() and took_over == ""
