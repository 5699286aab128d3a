"""gemps.job_vote: the job a client naming none takes from its replica list: a job held at more than
half of its addresses; nothing (the first registration decides) where none is and the answers
agree; a refusal naming them where they disagree."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from gemps import errors
from gemps.job_vote import listed_job, status_of_job
from gemps.resolver import Replicas, StaticAddress
from gemps_proto.reasons import Reason


@dataclass(frozen=True)
class Answer:
    job: str


def probe_of(jobs: dict[str, str | None]) -> tuple[list[str], Callable[[str], Answer]]:
    """A probe answering each address's job (None: it does not answer), and the addresses asked."""
    asked: list[str] = []

    def probe(address: str) -> Answer:
        asked.append(address)
        job = jobs[address]
        if job is None:
            raise errors.ServerUnavailableError(f"{address} is down")
        return Answer(job)

    return asked, probe


def vote(jobs: dict[str, str | None]) -> str:
    return listed_job(Replicas(list(jobs)), probe_of(jobs)[1])


def test_a_job_held_at_more_than_half_the_list_is_taken() -> None:
    assert vote({"a:1": "ours", "b:1": "ours", "c:1": "theirs"}) == "ours"
    assert vote({"c:1": "theirs", "a:1": "ours", "b:1": "ours"}) == "ours"  # wherever the stale one stands
    assert vote({"a:1": "ours", "b:1": "ours"}) == "ours"


def test_no_majority_and_no_disagreement_leaves_it_to_the_first_registration() -> None:
    assert vote({"a:1": "ours", "b:1": None}) == ""  # one of two answers: it may be the stale one
    assert vote({"a:1": "", "b:1": "", "c:1": "theirs"}) == ""  # no θ yet at the job's own: no vote
    assert vote({"a:1": "ours", "b:1": "", "c:1": None}) == ""
    assert vote({"a:1": None, "b:1": None}) == ""


def test_answers_of_different_jobs_without_a_majority_are_refused_naming_each() -> None:
    with pytest.raises(errors.FailedPreconditionError) as refused:
        vote({"a:1": "ours", "c:1": "theirs"})
    assert refused.value.reason == Reason.OTHER_JOB
    assert "a:1 job ours" in refused.value.message and "c:1 job theirs" in refused.value.message
    assert "job=" in refused.value.message
    with pytest.raises(errors.FailedPreconditionError):
        vote({"a:1": "ours", "b:1": None, "c:1": "theirs"})  # 1 of 3 each: neither is more than half


def test_one_address_or_no_list_is_not_asked() -> None:
    asked, probe = probe_of({"a:1": "theirs"})
    assert listed_job(Replicas(["a:1"]), probe) == ""
    assert listed_job(StaticAddress("a:1"), probe) == ""
    assert asked == []


def test_an_observer_passes_over_another_jobs_server_once_round_the_list() -> None:
    answers, passed = [Answer("theirs"), Answer("ours")], list[errors.GempsError]()
    found = status_of_job(Replicas(["c:1", "a:1"]), "ours", lambda: answers.pop(0), passed.append)
    assert found == Answer("ours") and len(passed) == 1 and passed[0].reason == Reason.OTHER_JOB
    assert status_of_job(Replicas(["c:1", "a:1"]), "", lambda: Answer("theirs"), passed.append) == Answer("theirs")
    with pytest.raises(errors.FailedPreconditionError, match="job ours's"):
        status_of_job(Replicas(["c:1", "a:1"]), "ours", lambda: Answer("theirs"), passed.append)
    assert len(passed) == 1 + 3  # the list's two addresses and one more, then refused
