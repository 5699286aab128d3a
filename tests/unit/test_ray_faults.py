"""The Ray driver's fault bookkeeping (gemps_worker.on_ray.faults) and a worker actor's one
training run per life, without a cluster: the cluster-wide behaviour is tests/e2e/test_ray*.py's."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

# As the e2e Ray tests do, before ray is first imported (it reads this then): run in one session
# with them, whichever module imports ray first decides whether their nodes are on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
pytest.importorskip("ray")
import ray.exceptions

from gemps_worker.on_ray import actors
from gemps_worker.on_ray.faults import EVALUATOR, FaultLog, partition_name, why, worker_name
from gemps_worker.on_ray.records import ActorPlace, WorkerContext


def place(node: str, pid: int) -> ActorPlace:
    return ActorPlace(node, "10.0.0.1", -1, pid)


def test_a_lost_node_is_reported_once_with_the_actors_it_held() -> None:
    faults = FaultLog()
    faults.nodes(["a", "b", "c"])
    faults.seen(worker_name(0), place("a", 10))
    faults.seen(worker_name(1), place("b", 11))
    faults.seen(EVALUATOR, place("a", 12))
    lost = faults.nodes(["b", "c"])
    assert [(loss.node_id, loss.held) for loss in lost] == [("a", ("worker 0", "evaluator"))]
    assert faults.nodes(["b", "c"]) == []  # once
    assert faults.nodes(["b", "c", "d"]) == [] and "d" in faults.known  # a node that joins later is watched too
    assert faults.lost_partitions() == ""


def test_a_new_life_is_a_restart_and_says_whether_its_node_was_lost() -> None:
    faults = FaultLog()
    faults.nodes(["a", "b"])
    faults.seen(worker_name(0), place("a", 10))
    faults.seen(worker_name(0), place("a", 10))  # the same life, seen again
    faults.seen(worker_name(0), place("a", 20))  # its process died; Ray restarted it there
    faults.nodes(["b"])
    faults.seen(worker_name(0), place("b", 30))  # its node lost; restarted on another
    assert [(r.actor, r.previous_node_id, r.node_id, r.node_lost) for r in faults.restarts] == [
        ("worker 0", "a", "a", False),
        ("worker 0", "a", "b", True),
    ]
    assert faults.restarts_of(worker_name(0)) == 2 and faults.restarts_of(worker_name(1)) == 0


def test_a_failure_says_which_actor_after_how_many_restarts_and_why() -> None:
    faults = FaultLog()
    faults.nodes(["a", "b"])
    faults.seen(worker_name(2), place("a", 10))
    faults.seen(worker_name(2), place("b", 11))
    faults.nodes(["a"])
    died = ray.exceptions.ActorDiedError()
    assert faults.failure(worker_name(2), died, 1) == (
        "worker 2 failed for good after 1 restart (--worker-restarts 1): its node b was lost; "
        "ActorDiedError: The actor died unexpectedly before finishing this task."
    )
    raised = ValueError("bad batch")  # its training function's own error: no restart talk
    assert faults.failure(worker_name(0), raised, 3) == "worker 0 failed: bad batch"


def test_losing_a_partition_node_ends_the_job_with_a_message_that_says_why() -> None:
    faults = FaultLog()
    faults.nodes(["a", "b"])
    faults.seen(partition_name(1), place("b", 10))
    faults.seen(worker_name(0), place("a", 11))
    faults.nodes(["a"])
    message = faults.failure(worker_name(0), ValueError("partition 1 unreachable"), 3)
    assert message.startswith("lost the node of partition 1 (node b): a partition does not move to another node yet")
    assert "--work-dir" in message and message.endswith("(worker 0: ValueError: partition 1 unreachable)")


def test_why_is_one_line_ending_with_rays_cause() -> None:
    error = ray.exceptions.RayActorError(error_msg="The actor died.\n\tpid: 7\n\tip: 10.0.0.1\nIts node died.")
    assert why(error) == "RayActorError: Its node died."


def test_a_retried_train_call_waits_for_the_running_one_instead_of_training_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ray retries train() when the actor stops answering; where only the network failed, the
    retry reaches the same life, which must not train its budget a second time."""
    monkeypatch.setattr(actors, "node_id", lambda: "node")
    started, release = threading.Event(), threading.Event()
    runs: list[int] = []

    def train(context: WorkerContext) -> int:
        runs.append(context.index)
        started.set()
        release.wait()
        return 42

    worker = actors.TrainingWorker(3, 4, "127.0.0.1:1", train=train)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(worker.train)
        assert started.wait(30)
        again = pool.submit(worker.train)
        release.set()
        outcomes = [first.result(30), again.result(30)]
    assert runs == [3]
    assert outcomes[0] == outcomes[1] and outcomes[0].value == 42
    assert worker.stop(timeout=0)  # its run is over
