"""The Ray driver's fault bookkeeping (gemps_worker.on_ray.faults) and a worker actor's one
training run per life, without a cluster: the cluster-wide behaviour is tests/e2e/test_ray*.py's."""

from __future__ import annotations

import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

# As the e2e Ray tests do, before ray is first imported (it reads this then): run in one session
# with them, whichever module imports ray first decides whether their nodes are on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
pytest.importorskip("ray")
import ray.exceptions

from gemps_worker.on_ray import actors
from gemps_worker.on_ray.addresses import ADDRESSES_FILE, layout, write_addresses
from gemps_worker.on_ray.faults import EVALUATOR, FaultLog, partition_name, why, worker_name
from gemps_worker.on_ray.records import ActorPlace, WorkerContext
from gemps_worker.on_ray.tether import earlier_ports


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


def test_losing_a_partition_node_without_a_work_dir_says_why_the_job_cannot_go_on() -> None:
    faults = FaultLog()
    faults.nodes(["a", "b"])
    faults.seen(partition_name(1), place("b", 10))
    faults.seen(worker_name(0), place("a", 11))
    faults.nodes(["a"])
    message = faults.lost_partitions()
    assert message.startswith(
        "lost the node of partition 1 (node b): its checkpoints were on that node (no --work-dir)"
    )
    assert "(no --work-dir)" in message and "Give --work-dir on storage every node sees" in message


def test_a_partition_whose_restarts_are_spent_says_so_by_its_own_flag() -> None:
    faults = FaultLog()
    faults.nodes(["a", "b"])
    faults.seen(partition_name(1), place("b", 10))
    faults.nodes(["a"])
    died = ray.exceptions.ActorDiedError()
    assert faults.failure(partition_name(1), died, 0, "--partition-restarts").startswith(
        "partition 1 failed for good after 0 restarts (--partition-restarts 0): its node b was lost; ActorDiedError"
    )


def test_partition_zero_announces_from_a_file_replaced_in_one_step(tmp_path: Path) -> None:
    path = tmp_path / ADDRESSES_FILE
    write_addresses(path, layout(["10.0.0.1:5000", "10.0.0.2:5001", "10.0.0.3:5002"]))
    assert path.read_text() == ",10.0.0.2:5001,10.0.0.3:5002\n"  # partition 0: "" (reached at the worker's target)
    write_addresses(path, layout(["", "10.0.0.4:6001", "10.0.0.3:5002"]))
    assert path.read_text() == ",10.0.0.4:6001,10.0.0.3:5002\n"
    assert [entry.name for entry in tmp_path.iterdir()] == [ADDRESSES_FILE]  # no temporary file left


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


def test_a_partition_restarted_where_its_checkpoints_are_not_refuses_to_start_from_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Ray restarted it on another node, and its folder there has no record of the job: --work-dir
    is not shared, and starting would serve a fresh θ for that partition."""
    monkeypatch.setattr(actors, "node_id", lambda: "node-b")
    monkeypatch.setattr(actors, "restarted", lambda: True)
    with pytest.raises(
        RuntimeError, match=r"partition 1 restarted on node node-b finds no record of job j1 .*--work-dir"
    ):
        actors.PartitionServer(
            1, 2, job="j1", work_dir=str(tmp_path), host="127.0.0.1", server_options={}, startup_timeout=1.0
        )


def listening(port: int = 0) -> socket.socket:
    listener = socket.socket()
    listener.bind(("127.0.0.1", port))
    listener.listen()
    return listener


def test_a_restarted_partition_keeps_its_free_ports_and_takes_a_fresh_one_where_another_process_listens(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A Ray worker bound the partition's old metrics port as a free one while the partition was
    down: the restart waited for it forever (its server could not listen there). Now the held port
    becomes a fresh one, named in a WARNING; the free one is kept. (The released port may be taken
    by another test's connection before it is checked, as it was once in a parallel run: then the
    check is made again with another.)"""
    with listening() as other:
        held = other.getsockname()[1]
        for _ in range(5):
            free = listening()
            free_port = free.getsockname()[1]
            free.close()  # what the dead server held, released
            chosen = earlier_ports("127.0.0.1", {"port": free_port, "metrics_port": held}, "partition 1", wait=0.3)
            if chosen["port"]:  # kept: else another process took it in between, and it was rightly not
                break
    assert chosen == {"port": free_port, "metrics_port": 0}
    assert f"partition 1: its earlier metrics port 127.0.0.1:{held} is held by another process" in caplog.text


def test_a_port_released_while_the_restart_waits_is_kept() -> None:
    """The earlier life's own server may hold its port a moment longer as it dies."""
    holder = listening()
    port = holder.getsockname()[1]
    threading.Timer(0.3, holder.close).start()
    assert earlier_ports("127.0.0.1", {"port": port}, "partition 0", wait=10.0) == {"port": port}
