"""Finite input that would overflow θ (issue 15, item 3): refused with INVALID_ARGUMENT (reason
`non_finite`), θ and every rule's state untouched, counted; checkpoints stay loadable."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import grpc
import numpy as np
import pytest

from gemps_proto.reasons import METADATA_KEY
from gemps_proto.schema import ParameterSpec, TrainingConfig
from gemps_proto.schema_proto import tensor_to_proto
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_server.checkpoint_files import Checkpoint, CheckpointError, list_checkpoints, load, save
from gemps_server.domain.records import StateImage
from gemps_server.domain.rules import create_rule
from gemps_server.domain.rules.base import StepContext
from gemps_server.domain.rules.gem import GemRule
from gemps_server.domain.rules.overflow import OverflowGuard
from tests.helpers import InProcessServer, scrape_series
from tests.integration.conftest import NUM_PARAMETERS, SPEC, StartServer, open_stub, register

HUGE = np.full(NUM_PARAMETERS, 3e38, np.float32)  # finite float32, near its largest
RULES = [("gem", "auto"), ("gem", "numpy"), ("downpour", "auto"), ("adaptive-staleness", "auto"), ("momentum", "auto")]
RULES += [("nesterov", "auto"), ("delayed-nesterov", "auto"), ("adamw", "auto")]  # adamw: in place where it can


def rule_state(server: InProcessServer) -> dict[str, bytes]:
    """Every float the rule keeps (per worker and global), as bytes."""
    rule = server.server.state.core.rule
    found = {key: value.tobytes() for key, value in rule.global_state().items()} if rule is not None else {}
    if isinstance(rule, GemRule):
        for worker_id, worker in rule._workers.items():
            found[f"{worker_id}.m"] = worker.proxy.tobytes()
            found[f"{worker_id}.s"] = worker.last_seen_theta.tobytes()
    return found


def commit(stub: Any, worker_id: str, version: int, values: np.ndarray, kind: Any) -> pb.CommitResponse:
    request = pb.CommitRequest(worker_id=worker_id, base_version=version, kind=kind, payload=tensor_to_proto(values))
    reply: pb.CommitResponse = stub.Commit(request)
    return reply


@pytest.mark.parametrize("kind", [pb.PAYLOAD_KIND_GRADIENT, pb.PAYLOAD_KIND_UPDATE], ids=["gradient", "update"])
@pytest.mark.parametrize(("rule", "kernel"), RULES, ids=[f"{r}-{k}" for r, k in RULES])
def test_a_commit_that_would_overflow_theta_is_refused_and_changes_nothing(
    start_server: StartServer, tmp_path: Path, rule: str, kernel: str, kind: int
) -> None:
    server = start_server(rule=rule, gem_kernel=kernel, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    stub = open_stub(server.target)
    worker_id = register(stub).worker_id
    other = register(stub).worker_id  # a second worker's GEM state must not move either
    commit(stub, other, 0, np.ones(NUM_PARAMETERS, np.float32), pb.PAYLOAD_KIND_GRADIENT)
    state = server.server.state
    refusal: grpc.RpcError | None = None
    for _ in range(100):  # 3e38 at eta 0.05: a few dozen commits at most before θ would overflow
        version, theta, kept = state.core.version, state.core.theta_copy(), rule_state(server)
        try:
            commit(stub, worker_id, version, HUGE, kind)
        except grpc.RpcError as error:
            refusal = error
            break
        assert np.isfinite(state.core.theta_copy()).all(), "an accepted commit made θ non-finite"
    assert refusal is not None, "every commit was accepted"
    assert refusal.code() == grpc.StatusCode.INVALID_ARGUMENT, refusal.details()
    metadata: Any = refusal.trailing_metadata()
    assert dict(metadata or ())[METADATA_KEY] == "non_finite"
    assert state.core.version == version
    np.testing.assert_array_equal(state.core.theta_copy(), theta)  # bit for bit
    assert rule_state(server) == kept
    status = stub.Status(pb.StatusRequest())
    assert status.commits_rejected == 1
    series = scrape_series(f"http://127.0.0.1:{server.metrics_port}/metrics")
    assert series['gemps_commits_total{outcome="rejected",reason="non_finite"}'] == 1
    # Honest work goes on from the same θ; except under `momentum`, `nesterov` and `delayed-nesterov`,
    # whose one global velocity, near float32's largest after the accepted huge commits, makes every
    # update overflow.
    honest = np.full(NUM_PARAMETERS, 1e-3, np.float32)
    if rule not in ("momentum", "nesterov", "delayed-nesterov"):
        assert commit(stub, other, state.core.version, honest, pb.PAYLOAD_KIND_GRADIENT).version == version + 1
    assert np.isfinite(state.core.theta_copy()).all()
    # Every checkpoint written loads.
    server.stop()
    for _, path in list_checkpoints(tmp_path):
        assert np.isfinite(load(path).image.theta).all()


def test_a_worker_registered_after_a_refusal_starts_from_the_unchanged_theta(server: InProcessServer) -> None:
    stub = open_stub(server.target)
    worker_id = register(stub).worker_id
    with pytest.raises(grpc.RpcError):
        for version in range(100):
            commit(stub, worker_id, version, HUGE, pb.PAYLOAD_KIND_UPDATE)
    request = pb.RegisterRequest(spec=SPEC)
    reply = stub.Register(request)
    values = np.frombuffer(reply.parameters.data, np.float32)
    assert values.size == NUM_PARAMETERS and np.isfinite(values).all()


@pytest.mark.parametrize("rule", ["gem", "downpour", "adaptive-staleness", "momentum", "nesterov", "delayed-nesterov"])
def test_out_of_place_updates_match_in_place_ones_bit_for_bit(rule: str) -> None:
    """Commits near float32's range run out of place (into spare buffers, then swapped): the same
    values as the in-place pass, and the rule goes on in place afterwards."""
    rng = np.random.default_rng(3)
    config = TrainingConfig(rule=rule)
    in_place, out_of_place = create_rule(config, 5000), create_rule(config, 5000)
    theta = rng.standard_normal(5000).astype(np.float32)
    thetas = [theta.copy(), theta.copy()]
    for made in (in_place, out_of_place):
        made.add_worker("a", theta)
    for step in range(6):
        gradient = rng.standard_normal(5000).astype(np.float32)
        thetas[0], stats = in_place.step(thetas[0], gradient, StepContext("a", 0, version=step))
        # A loose bound on |θ| (it only ever errs high) sends the commit out of place.
        guard = cast(OverflowGuard, out_of_place)  # the rules mix in rules/overflow.py's OverflowGuard
        guard.remember_peak(thetas[1], 1e38 if step % 2 == 0 else float(np.abs(thetas[1]).max()))
        thetas[1], other_stats = out_of_place.step(thetas[1], gradient, StepContext("a", 0, version=step))
        np.testing.assert_array_equal(thetas[0], thetas[1])
        assert stats == other_stats


def test_a_checkpoint_the_loader_would_refuse_is_never_written(tmp_path: Path) -> None:
    theta = np.array([1.0, np.inf], np.float32)
    image = StateImage(version=3, commits_applied=3, spec=(ParameterSpec("w", (2,)),), theta=theta)
    with pytest.raises(CheckpointError):
        save(tmp_path, Checkpoint(image))
    assert list(tmp_path.iterdir()) == []
