"""One job, one θ (issue 77, items 1 and 2; DESIGN §3d). A worker's replica list may hold an
address that now belongs to another job (a pod address reused by another job's primary, a stale
list). Before, the primary watch and the list's round robin followed anything whose Status said
PRIMARY; there the worker's commit was refused as "worker not found", the SDK registered again
with its own θ, and every later commit was acknowledged into the other job's θ (250 of 271 with
a primary merely paused 1.5 s, shorter than its lease). Now every server names the job its θ is
(fixed when θ is initialised, kept by every replica), a client sends the job of its first
registration at every later one and follows a replica only when its Status names that job: the
other job's server is skipped with a WARNING naming it, whatever its model."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

import gemps
import gemps.records
from gemps_proto.jobs import valid_job
from gemps_proto.reasons import METADATA_KEY
from gemps_proto.schema_proto import tensor_to_proto
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from gemps_server.replication.local_etcd import LocalEtcd
from gemps_worker.cluster import ServerProcess
from tests.helpers import CommitLoops, stop_process, wait_for
from tests.integration.conftest import NUM_PARAMETERS, SPEC, StartServer, StartServerProcess, open_stub
from tests.integration.test_replicas import LEASE, PARAMETERS, primary_and_backup

#: job A's lease in the first test: longer than the pause, so its primary stays primary throughout
LONG_LEASE = 6.0


def _other_job(start: StartServerProcess, etcd: LocalEtcd, name: str, parameters: int) -> str:
    """Job B: a replicated pair whose θ (zeros of `parameters` values) one client initialised; both
    replicas' addresses, which job A's workers are given too: whichever is B's primary then (a
    loaded machine may move it, the long lease notwithstanding) answers them as primary."""
    _, _, target = primary_and_backup(start, etcd, name, replica_lease=LONG_LEASE)
    with gemps.Client(target, name="b-owner", timeout=10) as owner:
        owner.register({"w": np.zeros(parameters, np.float32)})
    return target


def _untouched(target: str, parameters: int) -> str:
    """The empty string when job B's θ (at its replicas `target`) is as its owner registered it,
    else what it holds."""
    with gemps.Client(target, timeout=30) as observer:
        pulled = observer.pull()
    if pulled.version == 0 and pulled.flat.size == parameters and not pulled.flat.any():
        return ""
    return f"job B's θ moved: version {pulled.version}, values {pulled.flat.min()}..{pulled.flat.max()}"


def _warned_of(caplog: pytest.LogCaptureFixture, replicas: str) -> bool:
    """Whether a WARNING named one of `replicas` as another job's server, not followed."""
    return any(
        record.levelno == logging.WARNING
        and "central variable, not this worker's job" in record.getMessage()
        and any(address in record.getMessage() for address in replicas.split("|"))
        for record in caplog.records
    )


def _counted_exactly(target: str, loops: CommitLoops) -> str:
    """ "" when job A's θ holds every acknowledged commit once (updates of ones under downpour)."""
    with gemps.Client(target, timeout=10) as observer:
        pulled = observer.pull()
    if pulled.flat.min() == pulled.flat.max() == pulled.version == sum(loops.acked):
        return ""
    return f"job A: θ {pulled.flat.min()}..{pulled.flat.max()} at version {pulled.version}, acknowledged {loops.acked}"


def test_a_paused_primary_does_not_send_its_workers_to_another_jobs_primary(
    start_server_process: StartServerProcess, etcd: LocalEtcd, caplog: pytest.LogCaptureFixture
) -> None:
    """Job A's primary pauses for longer than the watch waits and shorter than its lease: its
    workers ask the list's other addresses; job B's primary, the same model, says PRIMARY. It is
    skipped with a WARNING naming it, and A's workers go on at A's primary once it resumes."""
    caplog.set_level(logging.WARNING, logger="gemps.client")
    theirs = _other_job(start_server_process, etcd, "theirs-same-model", PARAMETERS)
    ours, _, target = primary_and_backup(start_server_process, etcd, "ours-paused", replica_lease=LONG_LEASE)
    clients = [gemps.Client(f"{target}|{theirs}", name=f"a{i}") for i in range(2)]
    ones = np.ones(PARAMETERS, np.float32)
    loops = CommitLoops(clients, {"w": np.zeros(PARAMETERS, np.float32)}, ones, kind="update").start()
    try:
        loops.wait_each(5, 60, "5 commits per worker of job A")
        stop_process(ours.pid)
        # The watch asks the other replicas once a call waited a second: B's primary answers PRIMARY.
        wait_for(
            lambda: _warned_of(caplog, theirs) or _untouched(theirs, PARAMETERS) != "",
            30,
            "job A's workers to look at job B's primary",
        )
        os.kill(ours.pid, signal.SIGCONT)
        loops.wait_each(3, 60, "3 more commits per worker of job A, once its primary resumed")
    finally:
        loops.stop(timeout=30)
        os.kill(ours.pid, signal.SIGCONT)
    assert not loops.failures, loops.failures
    assert _untouched(theirs, PARAMETERS) == ""
    assert _counted_exactly(target, loops) == ""
    assert _warned_of(caplog, theirs)


def test_a_failover_skips_another_jobs_primary_of_another_model(
    start_server_process: StartServerProcess, etcd: LocalEtcd, caplog: pytest.LogCaptureFixture
) -> None:
    """Job A's primary is killed; job B's primary, another model, is on A's list. The workers used
    to register there, be refused for the spec and die (FailedPreconditionError) although A's
    backup took over within the lease: now they skip B and commit to A's new primary."""
    caplog.set_level(logging.WARNING, logger="gemps.client")
    theirs = _other_job(start_server_process, etcd, "theirs-other-model", 2 * PARAMETERS)
    ours, survivor, target = primary_and_backup(start_server_process, etcd, "ours-killed")
    clients = [gemps.Client(f"{target}|{theirs}", name=f"a{i}", timeout=30) for i in range(2)]
    ones = np.ones(PARAMETERS, np.float32)
    loops = CommitLoops(clients, {"w": np.zeros(PARAMETERS, np.float32)}, ones, kind="update").start()
    try:
        loops.wait_each(5, 60, "5 commits per worker of job A")
        ours.kill()
        loops.wait_each(5, 30 + 10 * LEASE, "5 commits per worker at job A's promoted backup")
    finally:
        loops.stop(timeout=30)
    assert not loops.failures, loops.failures
    assert _untouched(theirs, 2 * PARAMETERS) == ""
    assert _counted_exactly(survivor.target, loops) == ""
    assert _warned_of(caplog, theirs)


def _register(stub: pb_grpc.ParameterServerStub, job: str = "", client_id: str = "") -> pb.RegisterResponse:
    initial = tensor_to_proto(np.zeros(NUM_PARAMETERS, np.float32))
    return stub.Register(pb.RegisterRequest(spec=SPEC, initial_parameters=initial, job=job, client_id=client_id))


def _refusal(stub: pb_grpc.ParameterServerStub, job: str) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as refused:
        _register(stub, job)
    metadata: Any = refused.value.trailing_metadata()
    return refused.value.code(), dict(metadata or ())[METADATA_KEY]


def test_a_server_names_its_job_keeps_it_across_a_restart_and_refuses_another(
    start_server: StartServer, tmp_path: Path
) -> None:
    """The job is fixed when θ is initialised (the first registration's, when it names one), said by
    Register and Status, kept by the checkpoint; a registration of another job is refused
    FAILED_PRECONDITION (other_job) and one that is no job identity INVALID_ARGUMENT (bad_job),
    the server's workers and θ untouched."""
    server = start_server(checkpoint_dir=str(tmp_path))
    stub = open_stub(server.target)
    job = _register(stub, job="job-of-the-first-client").job
    assert job == "job-of-the-first-client" == stub.Status(pb.StatusRequest()).job
    assert _register(stub, job=job, client_id="second").job == job  # the same job: admitted
    assert _refusal(stub, "another-job") == (grpc.StatusCode.FAILED_PRECONDITION, "other_job")
    assert _refusal(stub, "not a job!") == (grpc.StatusCode.INVALID_ARGUMENT, "bad_job")
    status = stub.Status(pb.StatusRequest())
    assert (status.active_workers, status.version) == (2, 0)
    server.stop()  # its final checkpoint holds the job
    stub = open_stub(start_server(checkpoint_dir=str(tmp_path)).target)
    assert stub.Status(pb.StatusRequest()).job == job
    assert _refusal(stub, "another-job") == (grpc.StatusCode.FAILED_PRECONDITION, "other_job")
    assert _register(stub).job == job  # a client new to the job joins it


def test_a_fresh_server_makes_up_a_job_and_a_backup_holds_its_primarys(
    start_server_process: StartServerProcess, etcd: LocalEtcd
) -> None:
    """With no job named, the first registration's θ gets a new one; the backup, seeded and replaying
    the primary's journal, answers with the same."""
    primary, backup, target = primary_and_backup(start_server_process, etcd, "job-on-backups")
    with gemps.Client(target, timeout=10) as client:
        client.register({"w": np.zeros(PARAMETERS, np.float32)})
        job = client.status().job
    assert valid_job(job)
    wait_for(lambda: _status(backup).job == job, 30, "the backup to hold its primary's job")
    assert _status(primary).job == job


def _status(server: ServerProcess) -> gemps.records.ServerStatus:
    with gemps.Client(server.target, timeout=10) as client:
        return client.status()


def test_a_worker_that_names_its_job_never_registers_with_another_jobs_primary(
    start_server_process: StartServerProcess, etcd: LocalEtcd, caplog: pytest.LogCaptureFixture
) -> None:
    """A first registration trusts whoever answers as primary unless the worker names its job
    (`Client(job=...)`): its list starts with job B's replicas, whose primary answers first, and
    it goes on to job A's, whose θ a worker of that name initialised (the Jepsen suite's seed 7:
    a worker starting while its job had no primary registered with the other's)."""
    caplog.set_level(logging.WARNING, logger="gemps.client")
    theirs = _other_job(start_server_process, etcd, "theirs-first", PARAMETERS)
    _, _, target = primary_and_backup(start_server_process, etcd, "ours-named")
    with gemps.Client(target, name="a-first", timeout=30, job="ours-named") as first:
        first.register({"w": np.zeros(PARAMETERS, np.float32)})
        assert first.status().job == "ours-named"
    with gemps.Client(f"{theirs}|{target}", name="a-late", timeout=60, job="ours-named") as late:
        late.register({"w": np.zeros(PARAMETERS, np.float32)})
        assert late.commit(np.ones(PARAMETERS, np.float32), kind="update").version == 1
    assert _untouched(theirs, PARAMETERS) == ""
    assert any("other_job" in record.getMessage() or "another job" in record.getMessage() for record in caplog.records)
    with pytest.raises(ValueError, match="job must be"):
        gemps.Client(target, job="not a job")


def _lone_other_job(start: StartServerProcess) -> str:
    """Job B: one server (not replicated) whose θ, of job A's model, a client initialised."""
    server = start()
    with gemps.Client(server.target, name="b-owner", timeout=10) as owner:
        owner.register({"w": np.zeros(PARAMETERS, np.float32)})
    return server.target


def _initialised_pair(start: StartServerProcess, etcd: LocalEtcd, name: str) -> str:
    """Job A: a replicated pair whose θ one client initialised, once both replicas name its job."""
    primary, backup, target = primary_and_backup(start, etcd, name)
    with gemps.Client(target, name="a-owner", timeout=10) as owner:
        owner.register({"w": np.zeros(PARAMETERS, np.float32)})
        job = owner.status().job
    wait_for(lambda: _status(backup).job == job == _status(primary).job, 30, "both replicas to name job A")
    return target


def test_a_worker_naming_no_job_takes_the_job_most_of_its_list_holds(
    start_server_process: StartServerProcess, etcd: LocalEtcd, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker that names no job, given a list whose first address is another job's server (the
    same model) and whose other two are its job's replicas: it registered with the first, silently
    training job B's θ. Now the list is asked first: job A, held at 2 of its 3 addresses, is taken
    as if named, B refuses the worker (other_job) and its commits land in A's θ."""
    caplog.set_level(logging.WARNING, logger="gemps.client")
    theirs = _lone_other_job(start_server_process)
    ours = _initialised_pair(start_server_process, etcd, "ours-voted")
    with gemps.Client(f"{theirs}|{ours}", name="a-unnamed", timeout=60) as worker:
        worker.register({"w": np.zeros(PARAMETERS, np.float32)})
        assert worker.commit(np.ones(PARAMETERS, np.float32), kind="update").version == 1
        assert worker.status().job == _status_of(ours).job
    assert _untouched(theirs, PARAMETERS) == ""
    assert any(
        theirs in record.getMessage() and "this worker takes job" in record.getMessage() for record in caplog.records
    )


def test_a_worker_naming_no_job_whose_list_holds_two_jobs_equally_is_refused_naming_them(
    start_server_process: StartServerProcess, etcd: LocalEtcd
) -> None:
    """One address of job B, one of job A: nothing says which is the worker's. It is refused before
    it registers anywhere (FAILED_PRECONDITION, other_job), the message naming both addresses and
    how to name the job; job B's θ untouched."""
    theirs = _lone_other_job(start_server_process)
    ours = _initialised_pair(start_server_process, etcd, "ours-tied").split("|")[0]
    worker = gemps.Client(f"{theirs}|{ours}", name="a-unnamed", timeout=30)
    with worker, pytest.raises(gemps.FailedPreconditionError) as refused:
        worker.register({"w": np.zeros(PARAMETERS, np.float32)})
    assert refused.value.reason == gemps.Reason.OTHER_JOB
    assert theirs in refused.value.message and ours in refused.value.message and "job=" in refused.value.message
    assert _untouched(theirs, PARAMETERS) == ""


def _status_of(target: str) -> gemps.records.ServerStatus:
    with gemps.Client(target, timeout=10) as client:
        return client.status()


def test_the_reference_worker_names_its_job_and_another_jobs_server_refuses_it(
    start_server_process: StartServerProcess,
) -> None:
    """`gemps worker --job` (GEMPS_JOB): the worker sends its job from its first registration on, so
    a server whose θ is another job's refuses it, touching nothing (the address is taken for one
    whose server is gone: the worker ends once its patience is spent, exit 1, naming both jobs); a
    job that is no job identity is refused before anything is loaded (exit 2)."""
    theirs = _lone_other_job(start_server_process)
    command = [sys.executable, "-m", "gemps_cli", "worker", "--server", theirs, "--max-steps", "3", "--patience", "5"]
    refused = subprocess.run([*command, "--job", "ours-named"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1, refused.stderr[-3000:]
    assert "not job ours-named's" in refused.stderr and "another job" in refused.stderr, refused.stderr[-3000:]
    assert _untouched(theirs, PARAMETERS) == ""
    bad = subprocess.run(
        command, capture_output=True, text=True, timeout=120, env={**os.environ, "GEMPS_JOB": "no job"}
    )
    assert bad.returncode == 2 and "job: 'no job' is not a job" in bad.stderr, bad.stderr[-3000:]


def test_an_observer_naming_no_job_reads_and_reports_to_the_job_most_of_its_list_holds(
    start_server_process: StartServerProcess, etcd: LocalEtcd
) -> None:
    """An evaluator's client pulls before any registration: given a list whose first address is
    another job's server (the same model), it read that job's θ and reported its held-out figures
    there. Now it passes that server over for the job most of its list holds."""
    theirs = _lone_other_job(start_server_process)
    ours = _initialised_pair(start_server_process, etcd, "ours-observed")
    with gemps.Client(ours, name="a-worker", timeout=30) as worker:
        worker.register({"w": np.zeros(PARAMETERS, np.float32)})
        worker.commit(np.ones(PARAMETERS, np.float32), kind="update")
    with gemps.Client(f"{theirs}|{ours}", name="evaluator", timeout=60) as observer:
        pulled = observer.pull()
        assert pulled.version == 1 and pulled.flat.min() == 1.0  # job A's θ, one commit of ones
        observer.report_evaluation(pulled.version, loss=0.5, accuracy=0.9, num_samples=10)
    assert _status_of(theirs).last_evaluation is None
    assert _untouched(theirs, PARAMETERS) == ""
