"""A job's identity: which job's θ a server holds (DESIGN §3d, "One job, one θ").

A server names its θ's job when θ is first initialised: the identity the registering client sent
(RegisterRequest.job, one it learned from another server of the job), else a new random one. The
name stays with θ through checkpoints, journals and replica images, so every replica and every
restart of the job answers with it (RegisterResponse.job, StatusResponse.job). A client fixes it at
its first registration and sends it at every later one; a server holding another job's θ refuses
(reason other_job), and a client follows a replica only when its Status names the same job. An
address in a replica list that now belongs to another job (a reused pod address) thus never takes
a commit. Not a credential: it tells jobs apart, it does not keep anyone out.
"""

from __future__ import annotations

import re
import uuid

#: the most characters of a job's identity (a generated one is 32 hex digits)
MAX_JOB_LENGTH = 64
_JOB = re.compile(rf"[A-Za-z0-9_-]{{1,{MAX_JOB_LENGTH}}}")


def new_job() -> str:
    """A fresh job identity: 128 random bits as hex."""
    return uuid.uuid4().hex


def valid_job(job: str) -> bool:
    """Whether `job` may name a job ("" is not one: it means none said)."""
    return _JOB.fullmatch(job) is not None


def check_job(job: str) -> str:
    """`job` when it is "" (none named) or may name a job; else a ValueError naming it."""
    if job and not valid_job(job):
        raise ValueError(f"bad job {job[:80]!r}: a job must be 1-{MAX_JOB_LENGTH} characters of [A-Za-z0-9_-]")
    return job


def describe_job(job: str) -> str:
    """A job identity for messages: its first 12 characters (enough to tell jobs apart)."""
    return job[:12] if job else "(none)"
