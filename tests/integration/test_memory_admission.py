"""Memory admission of registrations under a real memory limit (issue 49, item 4): a `gemps server`
process whose address space is limited (RLIMIT_AS set on the running process, 1.5 GiB above what
it holds once serving), and GEM workers of an 8M-parameter model (64 MiB of m_i and s_i each)
registering until one does not fit.

Before the fix the registration that ran out of memory was answered `UNKNOWN: Unexpected
_ArrayMemoryError` and Status listed that worker as registered, holding its shard: the registry
entry was added before GEM's state was allocated. Now the budget settled from the limit refuses it
RESOURCE_EXHAUSTED (memory_budget) before anything is allocated; with a budget set above the memory
(`--memory-budget-mb`) the real MemoryError is refused RESOURCE_EXHAUSTED (out_of_memory). Either
way Status lists exactly the workers admitted, and they and θ are fine.
"""

from __future__ import annotations

import resource
from pathlib import Path

import grpc
import numpy as np
import pytest
from gemps_cli.main import main as gemps_main

import gemps
from gemps_proto.schema_proto import tensor_to_proto
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from gemps_worker.cluster import ServerProcess
from tests.helpers import server_outcome
from tests.integration.conftest import StartServer, StartServerProcess, open_stub

pytestmark = pytest.mark.timeout(180)

MIB = 1 << 20
P = 8 << 20  # θ of 32 MiB; GEM's state 64 MiB a worker
SPEC = [pb.ParameterSpec(name="w", shape=[P], dtype=pb.DTYPE_FLOAT32)]
ABOVE = 1536 * MIB  # the address space the server may still take once serving
MOST = 48  # registrations tried: more than 1.5 GiB of GEM state

# Ports the kernel picks: other tests may run at once (make test runs two runners).
FREE_PORTS = ("--port", "0", "--data-port", "0", "--metrics-port", "-1")


def vm_size(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmSize for process {pid}")


def limit_address_space(pid: int) -> None:
    limit = vm_size(pid) + ABOVE
    resource.prlimit(pid, resource.RLIMIT_AS, (limit, limit))


def register_until_refused(stub: pb_grpc.ParameterServerStub) -> tuple[list[str], grpc.RpcError]:
    """The workers admitted, in order, and the refusal of the next."""
    admitted: list[str] = []
    initial = tensor_to_proto(np.full(P, 0.5, np.float32))
    for index in range(MOST):
        request = pb.RegisterRequest(spec=SPEC, worker_name=f"w{index}", omit_parameters=True)
        if index == 0:
            request.initial_parameters.CopyFrom(initial)
        try:
            admitted.append(stub.Register(request, timeout=60).worker_id)
        except grpc.RpcError as error:
            return admitted, error
    raise AssertionError(f"{MOST} workers of 64 MiB of GEM state admitted in 1.5 GiB")


def refusal(error: grpc.RpcError) -> tuple[grpc.StatusCode, str, str]:
    assert isinstance(error, grpc.Call)
    reason = dict(error.trailing_metadata() or ()).get("gemps-reason", "")
    return error.code(), str(reason), error.details() or ""


def registered(stub: pb_grpc.ParameterServerStub) -> tuple[list[str], pb.StatusResponse]:
    status = stub.Status(pb.StatusRequest(), timeout=30)
    return sorted(worker.name for worker in status.workers), status


def filled(server: ServerProcess, reason: str) -> tuple[pb_grpc.ParameterServerStub, list[str], pb.StatusResponse, str]:
    """`server` under the limit, registered until one worker is refused for `reason`, and Status
    listing exactly the workers admitted: its stub, the workers, Status, the refusal's details."""
    limit_address_space(server.pid)
    stub = open_stub(server.target)
    admitted, refused = register_until_refused(stub)
    names, status = registered(stub)
    assert names == sorted(f"w{i}" for i in range(len(admitted))), "a refused worker is listed"
    code, label, details = refusal(refused)
    assert (code, label) == (grpc.StatusCode.RESOURCE_EXHAUSTED, reason), details
    return stub, admitted, status, details


def test_the_budget_from_the_memory_limit_refuses_the_worker_that_does_not_fit(
    start_server_process: StartServerProcess, tmp_path: Path
) -> None:
    server = start_server_process(rule="gem", max_message_mb=64, log_path=tmp_path / "server.log")
    stub, admitted, status, details = filled(server, "memory_budget")
    assert "--memory-budget-mb" in details and "RLIMIT_AS" in details
    assert status.rule_state_bytes == len(admitted) * 8 * P
    assert status.rule_state_bytes <= status.memory_budget_bytes < ABOVE
    assert "workers bound lowered by the memory budget" in server.log()
    # The reserve holds a commit's working copies: the earlier workers commit, θ moves.
    commit = pb.CommitRequest(
        worker_id=admitted[0], base_version=0, kind=pb.PAYLOAD_KIND_UPDATE, payload=tensor_to_proto(np.ones(P))
    )
    reply = stub.Commit(commit, timeout=60)
    assert reply.version == 1
    assert np.frombuffer(reply.parameters.data, np.float32)[0] > 0.5


def test_a_registration_that_runs_out_of_memory_leaves_no_worker_behind(
    start_server_process: StartServerProcess,
) -> None:
    """A budget set above the memory (1 TiB): the allocation itself fails, under the real limit."""
    server = start_server_process(rule="gem", max_message_mb=64, memory_budget_mb=1 << 20)
    stub, admitted, _, details = filled(server, "out_of_memory")
    assert "nothing was kept" in details
    # Workers leaving make room: the next registration is admitted, and θ is intact. (Room for
    # a Pull's copies of θ too: without it gRPC's own allocation fails, and a C++ bad_alloc
    # aborts the process. The default budget keeps that reserve.)
    for worker_id in admitted[:4]:
        stub.Leave(pb.LeaveRequest(worker_id=worker_id), timeout=30)
    again = stub.Register(pb.RegisterRequest(spec=SPEC, worker_name="again", omit_parameters=True), timeout=60)
    pulled = stub.Pull(pb.PullRequest(worker_id=again.worker_id), timeout=60)
    assert np.all(np.frombuffer(pulled.parameters.data, np.float32) == 0.5)
    assert len(registered(stub)[0]) == len(admitted) - 3


def test_a_start_whose_max_workers_cannot_fit_warns(tmp_path: Path) -> None:
    """256 GEM workers of a model of --max-parameters (2**28) need 512 GiB: far past 1 GiB."""
    exited, lines = server_outcome(tmp_path, *FREE_PORTS, "--memory-budget-mb", "1024")
    assert exited is None, lines  # it serves: the bound is set when θ's size is known
    (warning,) = [line for line in lines if "memory budget below --max-workers" in line]
    assert "512.0 GiB for 256 workers" in warning and "1.0 GiB (--memory-budget-mb)" in warning


def test_a_start_with_the_default_bounds_does_not_warn(tmp_path: Path) -> None:
    """With no budget set and --max-parameters at its default, what fits is not known until θ's
    size is: a WARNING then would fire on every machine, and is left to the initialisation."""
    exited, lines = server_outcome(tmp_path, *FREE_PORTS)
    assert exited is None, lines
    assert not [line for line in lines if "memory budget below" in line], lines


def test_gemps_status_shows_the_budget_and_its_use(
    start_server: StartServer, capsys: pytest.CaptureFixture[str]
) -> None:
    server = start_server(rule="gem", memory_budget_mb=64)
    with gemps.Client(server.target) as client:
        client.register({"w": np.zeros(1 << 20, np.float32)})  # 8 MiB of GEM state
        assert gemps_main(["status", "--server", server.target]) == 0
    out = capsys.readouterr().out
    assert "\nrule state      8.0 MiB of a 64.0 MiB memory budget (12%; raise it with --memory-budget-mb)\n" in out
