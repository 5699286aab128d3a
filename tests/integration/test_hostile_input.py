"""Hostile input, generated: over 10,000 malformed requests (hypothesis) against one real server.

Every request is answered with the status the protocol promises (an oracle here restates the
checks in the order the server makes them), the server never crashes or hangs (each call has a
deadline), the central variable stays bit-for-bit what it was and finite, every refused commit
is counted, and the server is still healthy at the end.
"""

from __future__ import annotations

import math
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gemps_proto import versions
from gemps_proto.schema_proto import tensor_to_proto, versions_from_proto
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_worker.cluster import ServerProcess
from tests.integration.conftest import NUM_PARAMETERS, SPEC, central, open_stub, register

Code = grpc.StatusCode
INT64 = st.integers(-(2**63), 2**63 - 1)
INT32 = st.integers(-(2**31), 2**31 - 1)
DEADLINE = 10.0  # seconds: a hang fails the call instead of the whole run
SETUP_COMMITS = 3  # so that both stale and future base versions exist
EXAMPLES = {"Register": 1500, "Commit": 3500, "Pull": 1200, "Leave": 1000, "ReportEvaluation": 1500, "raw": 1500}
# hypothesis: no deadline per example (a loaded machine), no example database, fixed seed.
SETTINGS: dict[str, Any] = {
    "deadline": None,
    "database": None,
    "derandomize": True,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
}


@dataclass
class Target:
    """The server, its one registered worker, and the central variable that must not change."""

    server: ServerProcess
    stub: object
    channel: grpc.Channel
    worker_id: str
    version: int
    theta: bytes
    sent: Counter[str] = field(default_factory=Counter)
    codes: Counter[tuple[str, str]] = field(default_factory=Counter)
    commits_reaching_handler: int = 0

    def call(self, method: str, request: object) -> tuple[Code, object]:
        self.sent[method] += 1
        try:
            reply = getattr(self.stub, method)(request, timeout=DEADLINE)
        except grpc.RpcError as error:
            code = error.code()
            assert code != Code.DEADLINE_EXCEEDED, f"{method} hung"
            self.codes[(method, code.name)] += 1
            return code, None
        self.codes[(method, "OK")] += 1
        return Code.OK, reply

    def pull_stream(self, request: bytes) -> tuple[Code, pb.PullResponse | None, bytes]:
        """PullStream with raw request bytes: the code, the header and the data pieces joined."""
        self.sent["PullStream"] += 1
        call: grpc.UnaryStreamMultiCallable[bytes, bytes] = self.channel.unary_stream(
            "/gemps.v1.ParameterServer/PullStream"
        )
        try:
            replies = [pb.PullResponseChunk.FromString(r) for r in call(request, timeout=DEADLINE)]
        except grpc.RpcError as error:
            code = error.code()
            assert code != Code.DEADLINE_EXCEEDED, "PullStream hung"
            self.codes[("PullStream", code.name)] += 1
            return code, None, b""
        self.codes[("PullStream", "OK")] += 1
        assert replies and replies[0].WhichOneof("part") == "header"
        assert all(r.WhichOneof("part") == "data" for r in replies[1:])
        return Code.OK, replies[0].header, b"".join(r.data for r in replies[1:])


@pytest.fixture(scope="module")
def target() -> object:
    # No registration rate limit and a long lease: the oracle assumes the worker stays known.
    with ServerProcess(max_registrations_per_minute=0, lease_ttl=3600, max_message_mb=4) as server:
        stub = open_stub(server.target)
        worker_id = register(stub).worker_id
        for version in range(SETUP_COMMITS):
            stub.Commit(
                pb.CommitRequest(
                    worker_id=worker_id,
                    base_version=version,
                    kind=pb.PAYLOAD_KIND_GRADIENT,
                    payload=tensor_to_proto(np.full(NUM_PARAMETERS, 0.1, np.float32)),
                    request_id=uuid.uuid4().hex,
                )
            )
        version, theta = central(stub)
        yield Target(server, stub, grpc.insecure_channel(server.target), worker_id, version, theta)


# -- the oracle: what the server must answer -----------------------------------------------------------


def register_code(request: pb.RegisterRequest) -> Code:
    if not versions.compatible(versions.THIS, versions_from_proto(request) or versions.LEGACY):  # checked first
        return Code.FAILED_PRECONDITION
    if not request.spec:
        return Code.INVALID_ARGUMENT
    seen = set()
    for entry in request.spec:
        if not entry.name or entry.name in seen or entry.dtype != pb.DTYPE_FLOAT32 or any(d < 0 for d in entry.shape):
            return Code.INVALID_ARGUMENT
        seen.add(entry.name)
    if sum(math.prod(entry.shape) for entry in request.spec) == 0:  # a model of no values
        return Code.INVALID_ARGUMENT
    same = [(s.name, list(s.shape)) for s in request.spec] == [(s.name, list(s.shape)) for s in SPEC]
    return Code.OK if same else Code.FAILED_PRECONDITION


def valid_payload(target: Target, request: pb.CommitRequest) -> bool:
    tensor = request.payload
    if request.kind not in (pb.PAYLOAD_KIND_GRADIENT, pb.PAYLOAD_KIND_UPDATE) or tensor.dtype != pb.DTYPE_FLOAT32:
        return False
    if list(tensor.shape) != [NUM_PARAMETERS] or len(tensor.data) != 4 * NUM_PARAMETERS:
        return False
    if not 0 <= request.base_version <= target.version:
        return False
    return bool(np.isfinite(np.frombuffer(tensor.data, "<f4")).all())


# Wire formats a reply may ask for (unspecified means float32).
REPLY_DTYPES = (pb.DTYPE_UNSPECIFIED, pb.DTYPE_FLOAT32, pb.DTYPE_BFLOAT16)


def commit_code(target: Target, request: pb.CommitRequest) -> Code:
    if request.reply_dtype not in REPLY_DTYPES:  # checked first (raw bytes can set it)
        return Code.INVALID_ARGUMENT
    if len(request.request_id) > 128:
        return Code.INVALID_ARGUMENT
    if request.worker_id != target.worker_id:
        return Code.NOT_FOUND
    return Code.OK if valid_payload(target, request) else Code.INVALID_ARGUMENT


def pull_code(target: Target, request: pb.PullRequest) -> Code:
    if request.worker_id not in ("", target.worker_id):
        return Code.NOT_FOUND
    return Code.OK if request.reply_dtype in REPLY_DTYPES else Code.INVALID_ARGUMENT  # after the worker


def evaluation_code(target: Target, report: pb.EvaluationReport) -> Code:
    if not (math.isfinite(report.loss) and report.loss >= 0) or not 0.0 <= report.accuracy <= 1.0:
        return Code.INVALID_ARGUMENT
    return Code.OK if report.version <= target.version else Code.INVALID_ARGUMENT


# -- generators -------------------------------------------------------------------------------------------

names = st.one_of(st.sampled_from([s.name for s in SPEC]), st.text(max_size=12))
shapes = st.lists(st.one_of(st.integers(-3, 20), INT64), max_size=4)
dtypes = st.one_of(st.just(pb.DTYPE_FLOAT32), st.just(pb.DTYPE_UNSPECIFIED), INT32)
floats = hnp.arrays(
    np.float32,
    st.sampled_from([NUM_PARAMETERS, NUM_PARAMETERS - 1, NUM_PARAMETERS + 1, 0, 1, 12]),
    elements=st.floats(width=32, allow_nan=True, allow_infinity=True),
)


@st.composite
def tensors(draw: st.DrawFn) -> pb.Tensor:
    if draw(st.booleans()):
        array = draw(floats)
        shape = draw(st.one_of(st.just(list(array.shape)), shapes))
        return pb.Tensor(dtype=draw(dtypes), shape=shape, data=array.astype("<f4").tobytes())  # type: ignore[arg-type]
    return pb.Tensor(dtype=draw(dtypes), shape=draw(shapes), data=draw(st.binary(max_size=96)))  # type: ignore[arg-type]


def spec_entries() -> st.SearchStrategy[pb.ParameterSpec]:
    return st.builds(lambda n, s, d: pb.ParameterSpec(name=n, shape=s, dtype=d), names, shapes, dtypes)


@st.composite
def register_requests(draw: st.DrawFn) -> pb.RegisterRequest:
    if draw(st.booleans()):  # the server's own spec with one thing wrong
        spec = [pb.ParameterSpec(name=s.name, shape=list(s.shape), dtype=s.dtype) for s in SPEC]
        mutation = draw(st.sampled_from(["shape", "name", "dtype", "drop", "add", "swap", "duplicate", "negative"]))
        index = draw(st.integers(0, len(spec) - 1))
        if mutation == "shape":
            spec[index].shape.append(draw(st.integers(0, 2**40)))
        elif mutation == "name":
            spec[index].name = draw(st.text(max_size=8).filter(lambda n: n not in {s.name for s in SPEC}))
        elif mutation == "dtype":
            spec[index].dtype = draw(dtypes.filter(lambda d: d != pb.DTYPE_FLOAT32))  # type: ignore[assignment]
        elif mutation == "drop":
            del spec[index]
        elif mutation == "add":
            spec.append(draw(spec_entries()))
        elif mutation == "swap":
            spec.reverse()
        elif mutation == "duplicate":
            spec.append(spec[index])
        else:
            spec[index].shape[0] = draw(st.integers(-(2**63), -1))
    else:
        spec = draw(st.lists(spec_entries(), max_size=4))
    request = pb.RegisterRequest(spec=spec, worker_name=draw(st.text(max_size=30)))
    if draw(st.booleans()):
        request.initial_parameters.CopyFrom(draw(tensors()))
    return request


COMMIT_DEFECTS = ("kind", "dtype", "shape", "length", "negative", "future", "non_finite", "request_id", "worker")


@st.composite
def commit_requests(draw: st.DrawFn, worker_id: str, version: int) -> pb.CommitRequest:
    """Mostly plausible commits (the real worker, a float32 payload), each with a defect forced in."""
    good = draw(st.booleans())
    values = np.full(NUM_PARAMETERS, 0.25, np.float32)
    request = pb.CommitRequest(
        worker_id=worker_id,  # unknown ones: the "worker" defect
        base_version=draw(st.integers(0, version)) if good else draw(INT64),
        kind=draw(st.sampled_from([pb.PAYLOAD_KIND_GRADIENT, pb.PAYLOAD_KIND_UPDATE])) if good else draw(INT32),  # type: ignore[arg-type]
        payload=tensor_to_proto(values) if good else draw(tensors()),
        request_id=draw(st.text(max_size=64)),
    )
    if draw(st.booleans()):
        request.loss = draw(st.floats(allow_nan=True, allow_infinity=True))
    if draw(st.booleans()):
        request.num_samples = draw(st.integers(0, 2**32 - 1))
    defect = draw(st.sampled_from(COMMIT_DEFECTS))
    payload = request.payload
    if defect == "worker":
        request.worker_id = "w-" + draw(st.text(max_size=40))
    elif defect == "kind":
        request.kind = draw(INT32.filter(lambda k: k not in (1, 2)))  # type: ignore[assignment]
    elif defect == "dtype":
        payload.dtype = draw(INT32.filter(lambda d: d != pb.DTYPE_FLOAT32))  # type: ignore[assignment]
    elif defect == "shape":
        payload.shape[:] = draw(shapes.filter(lambda s: s != [NUM_PARAMETERS]))
    elif defect == "length":
        payload.data = draw(st.binary(max_size=200).filter(lambda b: len(b) != 4 * NUM_PARAMETERS))
    elif defect == "negative":
        request.base_version = draw(st.integers(-(2**63), -1))
    elif defect == "future":
        request.base_version = draw(st.integers(version + 1, 2**63 - 1))
    elif defect == "non_finite":
        broken = values.copy()
        broken[draw(st.integers(0, NUM_PARAMETERS - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
        payload.CopyFrom(tensor_to_proto(broken))
    else:
        request.request_id = draw(st.text(min_size=129, max_size=300))
    return request


evaluation_reports = st.builds(
    lambda version, loss, accuracy, samples, dataset: pb.EvaluationReport(
        version=version, loss=loss, accuracy=accuracy, num_samples=samples, dataset=dataset
    ),
    st.integers(0, 2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(0, 2**64 - 1),
    st.text(max_size=200),
)


# -- the run ------------------------------------------------------------------------------------------------


def check_central_variable(target: Target) -> None:
    version, theta = central(target.stub)  # type: ignore[arg-type]
    assert (version, theta) == (target.version, target.theta), "the central variable changed"
    assert np.isfinite(np.frombuffer(theta, np.float32)).all()


def run_register(target: Target) -> None:
    @settings(max_examples=EXAMPLES["Register"], **SETTINGS)
    @given(register_requests())
    def case(request: pb.RegisterRequest) -> None:
        expected = register_code(request)
        code, reply = target.call("Register", request)
        assert code == expected, (code, expected, request)
        if code == Code.OK:  # a spec that happened to match: it registered; leave again
            assert reply.version == target.version  # type: ignore[attr-defined]
            assert reply.parameters.data == target.theta  # type: ignore[attr-defined]
            target.call("Leave", pb.LeaveRequest(worker_id=reply.worker_id))  # type: ignore[attr-defined]

    case()


def run_commit(target: Target) -> None:
    @settings(max_examples=EXAMPLES["Commit"], **SETTINGS)
    @given(commit_requests(target.worker_id, target.version))
    def case(request: pb.CommitRequest) -> None:
        expected = commit_code(target, request)
        assert expected != Code.OK, "generator produced a valid commit"
        target.commits_reaching_handler += 1
        code, _ = target.call("Commit", request)
        assert code == expected, (code, expected, request)

    case()


def run_pull(target: Target) -> None:
    @settings(max_examples=EXAMPLES["Pull"], **SETTINGS)
    @given(st.one_of(st.just(target.worker_id), st.just(""), st.text(max_size=40)), INT64)
    def case(worker_id: str, known_version: int) -> None:
        request = pb.PullRequest(worker_id=worker_id, known_version=known_version)
        code, reply = target.call("Pull", request)
        assert code == pull_code(target, request), (code, request)
        if code == Code.OK:
            assert reply.version == target.version  # type: ignore[attr-defined]
            assert reply.unchanged == (known_version == target.version)  # type: ignore[attr-defined]
            if not reply.unchanged:  # type: ignore[attr-defined]
                assert reply.parameters.data == target.theta  # type: ignore[attr-defined]
        # PullStream answers the same request the same way, θ in pieces.
        streamed_code, header, data = target.pull_stream(request.SerializeToString())
        assert streamed_code == code, (streamed_code, code, request)
        if header is not None:
            assert (header.version, header.unchanged) == (reply.version, reply.unchanged)  # type: ignore[attr-defined]
            assert data == (b"" if header.unchanged else target.theta)

    case()


def run_leave(target: Target) -> None:
    @settings(max_examples=EXAMPLES["Leave"], **SETTINGS)
    @given(st.text(max_size=80).filter(lambda w: w != target.worker_id))
    def case(worker_id: str) -> None:
        code, _ = target.call("Leave", pb.LeaveRequest(worker_id=worker_id))
        assert code == Code.NOT_FOUND

    case()


def run_evaluation(target: Target) -> None:
    @settings(max_examples=EXAMPLES["ReportEvaluation"], **SETTINGS)
    @given(evaluation_reports)
    def case(report: pb.EvaluationReport) -> None:
        code, _ = target.call("ReportEvaluation", report)
        assert code == evaluation_code(target, report), (code, report)

    case()


# Deliberately out-of-range enum values (ints) go into the messages below: hence the ignores.
METHODS: dict[str, tuple[Any, Any]] = {
    "Register": (pb.RegisterRequest, lambda t, r: register_code(r)),
    "Pull": (pb.PullRequest, pull_code),
    "PullStream": (pb.PullRequest, pull_code),
    "Commit": (pb.CommitRequest, commit_code),
    "Leave": (pb.LeaveRequest, lambda t, r: Code.NOT_FOUND),
    "Status": (pb.StatusRequest, lambda t, r: Code.OK),
    "ReportEvaluation": (pb.EvaluationReport, evaluation_code),
}


def run_raw(target: Target) -> None:
    """Random bytes as the payload of each method (and of methods that do not exist)."""

    @settings(max_examples=EXAMPLES["raw"], **SETTINGS)
    @given(st.sampled_from([*METHODS, "Nope"]), st.binary(max_size=300))
    def case(method: str, data: bytes) -> None:
        target.sent[f"raw {method}"] += 1
        if method == "PullStream":
            code, _, _ = target.pull_stream(data)
        else:
            call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = target.channel.unary_unary(
                f"/gemps.v1.ParameterServer/{method}"
            )
            try:
                call(data, timeout=DEADLINE)
                code = Code.OK
            except grpc.RpcError as error:
                code = error.code()
        target.codes[(f"raw {method}", code.name)] += 1
        if method == "Nope":
            assert code == Code.UNIMPLEMENTED
            return
        message_class, oracle = METHODS[method]
        if method == "Commit":  # parsed or not, a refused commit (reason "malformed" if not)
            target.commits_reaching_handler += 1
        try:
            parsed = message_class.FromString(data)
        except Exception:  # not a message of this type: refused as such
            assert code == Code.INVALID_ARGUMENT
            return
        expected = oracle(target, parsed)
        if method == "Register" and expected == Code.OK:  # pragma: no cover (astronomically unlikely)
            pytest.skip("random bytes spelled a valid registration")
        if method == "Commit":
            assert expected != Code.OK
        assert code == expected, (method, code, expected, parsed)

    case()


def test_ten_thousand_malformed_requests(target: Target) -> None:
    started = time.monotonic()
    for run in (run_register, run_commit, run_pull, run_leave, run_evaluation, run_raw):
        run(target)
        check_central_variable(target)
    elapsed = time.monotonic() - started
    total = sum(target.sent.values())
    print(f"\n{total} requests in {elapsed:.1f}s; answers: {dict(sorted(target.codes.items()))}")
    assert total >= 10_000
    # Every kind of refusal came up, not just the first check.
    assert {code for (_, code) in target.codes} >= {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION"}
    status = target.stub.Status(pb.StatusRequest(), timeout=DEADLINE)  # type: ignore[attr-defined]
    assert status.commits_applied == SETUP_COMMITS and status.version == target.version
    assert status.commits_rejected == target.commits_reaching_handler
    assert status.active_workers == 1
    health = health_pb2_grpc.HealthStub(target.channel).Check(health_pb2.HealthCheckRequest(), timeout=DEADLINE)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert target.server.returncode is None  # never crashed
    assert "Traceback" not in target.server.log()
