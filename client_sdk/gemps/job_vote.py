"""The job a client that names none takes from its replica list, before its first registration.

A client fixes its job at its first registration, unless it names one (DESIGN §3d, "One job, one
θ"). Given a list of replicas it trusted whichever address answered as primary first: a list
holding an address that another job's server had taken (a reused pod address, a stale list) could
start the worker in the other job's θ, silently when both train the same model (the Jepsen suite's
seed 7). So before that registration every address of the list is asked which job its θ is
(Status, within PROBE_SECONDS each), and:

- a job held at more than half of the list's addresses is the list's: the client takes it as if it
  were named (that job's servers admit it, any other refuses it: FAILED_PRECONDITION, other_job)
  and warns of each address holding another;
- answers naming different jobs, none of them at more than half the list: refused at once
  (FailedPreconditionError, reason other_job), naming each address's job, since nothing says which
  is this worker's: name the job, or take the stale address out of the list;
- otherwise (one job among the answers, at no more than half the addresses; no θ anywhere yet;
  no answer) nothing changes: the first registration fixes the job. A list most of whose
  addresses are silent cannot tell a stale address from the job's own: only a named job can.

An observer (a pull before any registration: an evaluator's) takes the list's job so too, and
passes over a server of another job for the list's next address (`status_of_job`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Protocol, TypeVar

from gemps import errors
from gemps.resolver import REPLICA_SEPARATOR, Replicas, Resolver
from gemps_proto.jobs import describe_job
from gemps_proto.reasons import Reason

log = logging.getLogger("gemps.client")

#: where a client names its job, for the messages
NAMING = "gemps.Client(job=...), `gemps worker --job` or GEMPS_JOB"


class NamesJob(Protocol):
    """What a server's Status says of its θ's job (gemps.records.ServerStatus)."""

    @property
    def job(self) -> str: ...


def listed_job(resolver: Resolver, probe: Callable[[str], NamesJob]) -> str:
    """The job of more than half of `resolver`'s addresses when it is a list of replicas, asked
    through `probe`; "" when the first registration is to fix it. Raises FailedPreconditionError
    when the addresses that answer hold different jobs and none holds more than half."""
    if not isinstance(resolver, Replicas) or len(resolver.addresses) < 2:
        return ""
    held: dict[str, str] = {}  # address -> the job of its θ (initialised)
    for address in resolver.addresses:
        try:
            job = probe(address).job
        except Exception as error:  # down or not answering: no vote
            log.debug("asked %s which job it holds: %s", address, error)
            continue
        if job:
            held[address] = job
    votes = Counter(held.values())
    if len(votes) < 2:
        job, count = votes.most_common(1)[0] if votes else ("", 0)
        return job if 2 * count > len(resolver.addresses) else ""
    job, count = votes.most_common(1)[0]
    named = ", ".join(f"{address} job {describe_job(held_job)}" for address, held_job in held.items())
    if 2 * count <= len(resolver.addresses):
        raise errors.FailedPreconditionError(
            f"the replica list {REPLICA_SEPARATOR.join(resolver.addresses)} holds different jobs' central variables "
            f"({named}) and no job is held at more than half of it: name this worker's job ({NAMING}) or take "
            "the addresses of the other jobs out of the list",
            reason=Reason.OTHER_JOB,
        )
    others = [address for address, held_job in held.items() if held_job != job]
    log.warning(
        "%s held another job's central variable than the rest of the replica list (%s): this worker takes job %s, "
        "held at %d of its %d addresses (name it: %s)",
        ", ".join(others), named, describe_job(job), count, len(resolver.addresses), NAMING,
    )  # fmt: skip
    return job


S = TypeVar("S", bound=NamesJob)


def status_of_job(
    resolver: Resolver, job: str, status: Callable[[], S], moving_on: Callable[[errors.GempsError], None]
) -> S:
    """An observer's first Status (a pull before any registration: an evaluator's), from a server of
    `job` when one is known: one of another job's (an address another job took) is passed over,
    `moving_on` told so that the next call goes to the list's next address, once round the list;
    then FailedPreconditionError (other_job). An observer would otherwise read that job's θ, and
    report its evaluations there."""
    for _ in range(len(resolver.addresses) + 1 if isinstance(resolver, Replicas) else 1):
        found = status()
        if not job or not found.job or found.job == job:
            return found
        passed = errors.ServerUnavailableError(
            f"a server of the list holds job {describe_job(found.job)}'s central variable, not this client's job "
            f"{describe_job(job)}: passed over",
            reason=Reason.OTHER_JOB,
        )
        log.warning("%s", passed.message)
        moving_on(passed)
    raise errors.FailedPreconditionError(
        f"no address of {resolver!r} answered with job {describe_job(job)}'s central variable",
        reason=Reason.OTHER_JOB,
    )
