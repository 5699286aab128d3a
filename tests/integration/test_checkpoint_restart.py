"""Checkpoints against real server processes: written every N commits, every T seconds and on
SIGTERM; restored on start; a crash between write and rename; deduplication across a restart;
graceful shutdown; `gemps export` into a torch model."""

from __future__ import annotations

import re
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import gemps
from gemps_proto.schema import ParameterSpec
from gemps_proto.schema_proto import tensor_to_proto
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_server.checkpoint_files import list_checkpoints, load, load_latest
from gemps_worker.cluster import ServerProcess
from tests.helpers import free_port, gemps_export, wait_for
from tests.integration.conftest import NUM_PARAMETERS, StartServer, open_stub, register

PARAMS = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(2, np.float32)}
QUICK_RETRY = gemps.RetryPolicy(max_attempts=60, initial_backoff=0.05, max_backoff=0.5)


def versions(directory: Path) -> list[int]:
    return [version for version, _ in list_checkpoints(directory)]


@pytest.fixture
def servers() -> Iterator[list[ServerProcess]]:
    """Servers a test starts itself (restarts on the same port); all stopped afterwards."""
    started: list[ServerProcess] = []
    yield started
    for server in started:
        server.close()


def start(servers: list[ServerProcess], **options: Any) -> ServerProcess:
    server = ServerProcess(**{"port": free_port(), **options}).start()  # restarted on its port: the suite's band
    servers.append(server)
    return server


def test_sigterm_writes_a_final_checkpoint_and_a_restart_restores_it(
    tmp_path: Path, servers: list[ServerProcess]
) -> None:
    options = {"checkpoint_dir": tmp_path, "checkpoint_every": 5, "checkpoint_interval": 0, "checkpoint_keep": 2}
    server = start(servers, **options)
    client = gemps.Client(server.target, retry=QUICK_RETRY)
    client.register(PARAMS)
    for _ in range(12):
        last = client.commit(np.ones(8, np.float32))
    # One every 5 commits: at 5 or a little later (commits go on while it is written), ...
    wait_for(lambda: versions(tmp_path) and versions(tmp_path)[-1] >= 5, what="a checkpoint by count")
    assert server.stop() == 0  # SIGTERM: graceful
    # ... and the final one at shutdown; older ones pruned to checkpoint_keep=2. How many were
    # written depends on the load: a loaded machine's count checkpoint was written at 12 already
    # (once in a full run), and the final one was of the same version.
    written = sorted(
        {int(version) for version in re.findall(r"checkpoint written path=\S+ version=(\d+)", server.log())}
    )
    assert versions(tmp_path) == written[-2:] and written[-1] == 12, written
    final = load(list_checkpoints(tmp_path)[-1][1])
    np.testing.assert_array_equal(final.image.theta, last.parameters.flat)
    assert final.image.spec == (ParameterSpec("w", (2, 3)), ParameterSpec("b", (2,))) and final.config["rule"] == "gem"
    assert re.search(r"checkpoint written path=\S+ version=12 bytes=\d+ seconds=", server.log())

    restarted = start(servers, port=server.port, **options)
    assert "checkpoint restored" in restarted.log()
    status = client.status()
    assert (status.initialized, status.version, status.commits_applied) == (True, 12, 12)
    # The old client's worker is unknown to the new process: it registers again by itself and
    # continues from the restored central variable.
    result = client.commit(np.ones(8, np.float32))
    assert result.version == 13
    np.testing.assert_allclose(result.parameters.flat, final.image.theta - 0.05, rtol=1e-6)
    client.close()


def test_sigkill_restarts_from_the_newest_checkpoint(tmp_path: Path, servers: list[ServerProcess]) -> None:
    options = {"checkpoint_dir": tmp_path, "checkpoint_every": 5, "checkpoint_interval": 0}
    server = start(servers, **options)
    client = gemps.Client(server.target)
    client.register(PARAMS)
    committed = [client.commit(np.ones(8, np.float32)).version for _ in range(10)]

    def second_checkpoint() -> bool:
        # One every 5 commits since the last: a loaded machine writes the first a few commits
        # late (at 9, say), and the second then waits for commit 14. Commit on until it is there.
        if len(versions(tmp_path)) >= 2:
            return True
        committed.append(client.commit(np.ones(8, np.float32)).version)
        return False

    wait_for(second_checkpoint, what="a second checkpoint")
    server.kill()
    client.close()
    newest = load(list_checkpoints(tmp_path)[-1][1])
    # Commits after the newest checkpoint (if any) are lost with the process.
    assert 10 <= newest.version <= committed[-1]
    restarted = start(servers, **options)
    stub = open_stub(restarted.target)
    reply = stub.Pull(pb.PullRequest(known_version=-1))
    assert reply.version == newest.version  # never further back than the newest checkpoint
    np.testing.assert_array_equal(np.frombuffer(reply.parameters.data, np.float32), newest.image.theta)


def test_time_based_checkpoints(tmp_path: Path, servers: list[ServerProcess]) -> None:
    server = start(servers, checkpoint_dir=tmp_path, checkpoint_every=0, checkpoint_interval=0.2)
    with gemps.Client(server.target) as client:
        client.register(PARAMS)
        wait_for(lambda: 0 in versions(tmp_path), what="checkpoint of the initial central variable")
        for _ in range(3):
            client.commit(np.ones(8, np.float32))
        wait_for(lambda: 3 in versions(tmp_path), what="checkpoint at version 3")


def commit(stub: object, worker_id: str, base: int, request_id: str) -> pb.CommitResponse:
    request = pb.CommitRequest(
        worker_id=worker_id,
        base_version=base,
        kind=pb.PAYLOAD_KIND_GRADIENT,
        payload=tensor_to_proto(np.full(NUM_PARAMETERS, 0.5, np.float32)),
        request_id=request_id,
    )
    return stub.Commit(request)  # type: ignore[attr-defined, no-any-return]


def test_a_retried_commit_is_applied_once_even_across_a_restart(tmp_path: Path, servers: list[ServerProcess]) -> None:
    options = {"checkpoint_dir": tmp_path, "checkpoint_every": 1, "checkpoint_interval": 0}
    server = start(servers, **options)
    stub = open_stub(server.target)
    worker = register(stub, client_id="client-1").worker_id  # request ids are this client's
    first = commit(stub, worker, 0, "req-1")
    again = commit(stub, worker, 0, "req-1")  # a retry: same request id
    assert (first.version, again.version) == (1, 1)
    assert again.parameters.data == first.parameters.data
    assert stub.Status(pb.StatusRequest()).commits_applied == 1
    wait_for(lambda: 1 in versions(tmp_path), what="checkpoint at version 1")
    server.kill()  # the reply to req-1 "was lost": the client retries against the new process

    restarted = start(servers, port=server.port, **options)
    stub = open_stub(restarted.target)
    worker = register(stub, client_id="client-1").worker_id  # registered again, under a new id
    retried = commit(stub, worker, 1, "req-1")
    assert retried.version == 1 and stub.Status(pb.StatusRequest()).commits_applied == 1
    assert commit(stub, worker, 1, "req-2").version == 2
    with pytest.raises(grpc.RpcError) as info:
        commit(stub, worker, 2, "x" * 200)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# The server process kills itself after writing a checkpoint past GEMPS_TEST_CRASH_FROM, just
# before renaming it into place.
CRASHING_BOOTSTRAP = (
    "import os, re, signal, sys\n"
    "_replace = os.replace\n"
    "def replace(src, dst, *args, **kwargs):\n"
    "    match = re.search(r'checkpoint-(\\d+)\\.safetensors$', str(dst))\n"
    "    if match and int(match.group(1)) >= int(os.environ['GEMPS_TEST_CRASH_FROM']):\n"
    "        os.kill(os.getpid(), signal.SIGKILL)\n"
    "    return _replace(src, dst, *args, **kwargs)\n"
    "os.replace = replace\n"
) + "from gemps_cli.main import main\nsys.exit(main(sys.argv[1:]))\n"


def test_a_crash_between_write_and_rename_leaves_the_previous_checkpoint(
    tmp_path: Path, servers: list[ServerProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    options = {"checkpoint_dir": tmp_path, "checkpoint_every": 4, "checkpoint_interval": 0}
    monkeypatch.setenv("GEMPS_TEST_CRASH_FROM", "5")
    server = start(servers, command=(sys.executable, "-c", CRASHING_BOOTSTRAP), **options)
    monkeypatch.undo()
    stub = open_stub(server.target)
    worker = register(stub).worker_id
    for version in range(4):
        commit(stub, worker, version, f"r{version}")
    wait_for(lambda: 4 in versions(tmp_path), what="checkpoint at version 4")
    with pytest.raises(grpc.RpcError):  # the process dies while writing the next checkpoint
        # Commit until it does: commits may outrun the checkpoint thread for a while (on a busy
        # machine 16 commits could all be applied before it reached the rename).
        for version in range(4, 100_000):
            commit(stub, worker, version, f"r{version}")
    assert wait_for(lambda: server.returncode is not None, what="the crash") and server.returncode == -9
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(leftovers) == 1 and versions(tmp_path) == [4]  # written, never renamed
    found = load_latest(tmp_path)
    assert found is not None and found[1].version == 4

    restarted = start(servers, **options)
    assert open_stub(restarted.target).Status(pb.StatusRequest()).version == 4
    assert "checkpoint temporary removed" in restarted.log()
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())


def test_graceful_shutdown_finishes_queued_commits_then_checkpoints(
    tmp_path: Path, servers: list[ServerProcess]
) -> None:
    server = start(servers, checkpoint_dir=tmp_path, checkpoint_every=0, checkpoint_interval=0, shutdown_grace=5)
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(server.target))
    watch = health.Watch(health_pb2.HealthCheckRequest(service="gemps.v1.ParameterServer"), timeout=60)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    acked = [0] * 4
    running = threading.Event()

    def train(index: int) -> None:
        client = gemps.Client(server.target, retry=gemps.RetryPolicy(max_attempts=2, initial_backoff=0.01))
        client.register(PARAMS)
        running.set()
        try:
            while True:
                client.commit(np.ones(8, np.float32))
                acked[index] += 1
        except gemps.GempsError:
            pass  # the server went away
        finally:
            client.close()

    threads = [threading.Thread(target=train, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    running.wait(30)
    wait_for(lambda: sum(acked) >= 40, what="40 commits")
    started = time.monotonic()
    assert server._process is not None
    server._process.terminate()  # SIGTERM
    statuses = [reply.status for reply in _until_closed(watch)]
    assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses  # load balancers see it first
    assert server._process.wait(30) == 0
    assert time.monotonic() - started < 5 + 10  # the grace period, plus the drain and the write
    for thread in threads:
        thread.join(30)
    final = load(list_checkpoints(tmp_path)[-1][1])
    # Every acknowledged commit is in the final checkpoint (some applied ones may have lost
    # their reply to the shutdown: those are in too, and a retry would be deduplicated).
    assert final.version >= sum(acked) > 0
    assert final.version == final.image.commits_applied
    log = server.log()
    assert log.index("shutting down") < log.index(f"version={final.version} bytes=") < log.index("stopped")


def _until_closed(stream: Iterator[health_pb2.HealthCheckResponse]) -> Iterator[health_pb2.HealthCheckResponse]:
    try:
        yield from stream
    except grpc.RpcError:
        return


def test_export_loads_into_a_torch_model(tmp_path: Path, start_server: StartServer) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    server = start_server(checkpoint_dir=tmp_path / "ckpt", checkpoint_every=1, checkpoint_interval=0)
    with gemps.Client(server.target) as client:
        client.register({n: p.detach().numpy() for n, p in model.named_parameters()})
        trained = client.commit(np.ones(sum(p.numel() for p in model.parameters()), np.float32)).parameters
        wait_for(lambda: 1 in versions(tmp_path / "ckpt"), what="checkpoint at version 1")
        for source in (["--server", server.target], [str(tmp_path / "ckpt")]):
            out = tmp_path / "model.safetensors"
            result = gemps_export(*source, out=out)
            assert result.returncode == 0, result.stderr
            assert "version 1, 4 tensors, 23 parameters" in result.stdout
            fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
            fresh.load_state_dict(load_file(str(out)))  # strict: every name and shape matches
            for name, value in fresh.state_dict().items():
                np.testing.assert_array_equal(value.numpy(), trained.named()[name])
            out.unlink()
    (tmp_path / "empty").mkdir()
    missing = gemps_export(str(tmp_path / "empty"), out=tmp_path / "x")
    assert missing.returncode == 1 and "no readable checkpoint" in missing.stderr


def test_an_unusable_checkpoint_dir_stops_the_start(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    server = ServerProcess(checkpoint_dir=tmp_path / "file" / "checkpoints")
    with pytest.raises(RuntimeError, match="exited with 2"):
        server.start()
    assert "cannot start" in server.log()


def test_failing_checkpoint_writes_do_not_stop_training(tmp_path: Path, servers: list[ServerProcess]) -> None:
    directory = tmp_path / "checkpoints"
    server = start(servers, checkpoint_dir=directory, checkpoint_every=1, checkpoint_interval=0)
    shutil.rmtree(directory)  # the server's lock file and all
    directory.write_text("the disk is gone")  # every write now fails
    with gemps.Client(server.target) as client:
        client.register(PARAMS)
        for _ in range(5):
            result = client.commit(np.ones(8, np.float32))
        assert result.version == 5  # commits keep flowing
        wait_for(lambda: "checkpoint failed" in server.log(), what="the failure logged")
        assert client.status().version == 5
    # Failures back off (10 s) instead of retrying, and logging, on every commit.
    assert 1 <= server.log().count("checkpoint failed") <= 2
